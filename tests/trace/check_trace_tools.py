"""The flight recorder's tools as a user runs them (ctest label "trace"):
`devbridge stream --trace`, `devbridge trace view` in headless Chromium, and
`devbridge trace replay`. Python's standard library only, so it runs with any
python3.

    check_trace_tools.py CLI CASE WORKDIR

CASE: stream_trace (a real trace validates as trace-event JSON), view (the page
opens in Chromium with no error and draws the memory plot), replay (exact and
deterministic), refusals (files that are not traces), large (a synthetic trace
of 10^5 events from make_large_trace.py: the page stays the trace's size, draws
every slice, and replay is deterministic).
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP = 77  # ctest's SKIP_RETURN_CODE for these tests


def run(cli, *args, expect=0):
    done = subprocess.run([cli, *args], capture_output=True, text=True, timeout=300)
    if done.returncode != expect:
        sys.exit(f"{' '.join(args)}: exit {done.returncode}, expected {expect}\n{done.stdout}\n{done.stderr}")
    return done


def stream_trace(cli, work):
    path = os.path.join(work, "stream.trace.json")
    done = run(cli, "stream", "--backend", "host", "--bytes", "16MiB", "--chunk", "1MiB", "--inflight", "4",
               "--trace", path, "--json", os.path.join(work, "report.json"), "-q")
    assert path in done.stderr, done.stderr
    with open(os.path.join(work, "report.json")) as f:
        assert json.load(f)["trace"] == path
    with open(path) as f:
        trace = json.load(f)
    validate(trace)
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"allocate", "free", "copy up", "copy down", "axpy", "memory"} <= names, names
    return path


def validate(trace):
    """The trace-event format as Chrome and Perfetto read it, and what devbridge promises on top."""
    assert trace["otherData"]["format"] == "devbridge-trace"
    assert trace["displayTimeUnit"] == "ns"
    events = trace["traceEvents"]
    last = 0.0
    open_slices = {}
    for e in events:
        assert e["ph"] in ("M", "B", "E", "i", "C"), e
        assert e["pid"] == 1, e
        if e["ph"] == "M":
            continue
        assert e["ts"] >= last, f"ts goes back at {e}"
        last = e["ts"]
        if e["ph"] == "B":
            open_slices.setdefault(e["tid"], []).append(e)
        elif e["ph"] == "E":
            assert open_slices.get(e["tid"]), f"an end with no begin on track {e['tid']}: {e}"
            begun = open_slices[e["tid"]].pop()
            assert begun["name"] == e["name"], (begun, e)
        elif e["ph"] == "C":
            assert all(v >= 0 for v in e["args"].values()), e
    assert not any(open_slices.values()), f"slices without an end: {open_slices}"


def png_pixels(path):
    """(width, height, rows of RGB tuples) of an 8-bit RGB or RGBA PNG."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, idat, header = 8, b"", None
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        at += 12 + length
    width, height, depth, colour = header[:4]
    assert depth == 8 and colour in (2, 6), header
    channels = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            left = line[x - channels] if x >= channels else 0
            up = previous[x]
            corner = previous[x - channels] if x >= channels else 0
            if kind == 1:
                line[x] = (line[x] + left) & 255
            elif kind == 2:
                line[x] = (line[x] + up) & 255
            elif kind == 3:
                line[x] = (line[x] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[x] = (line[x] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append([tuple(line[x:x + 3]) for x in range(0, stride, channels)])
        previous = line
    return width, height, rows


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def view(cli, work):
    browser = chromium()
    if browser is None:
        print("trace view: no chromium here (scripts/setup.sh installs Debian's); skipped")
        sys.exit(SKIP)
    trace = stream_trace(cli, work)
    page = os.path.join(work, "page.html")
    run(cli, "trace", "view", trace, "-o", page)
    with open(page) as f:
        text = f.read()
    assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text, "the page fetches"
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={os.path.join(work, 'profile')}"]
    dom = subprocess.run([browser, *flags, "--enable-logging=stderr", "--v=0", "--dump-dom", "file://" + page],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr
    assert 'data-error=' not in dom.stdout, dom.stdout[-2000:]
    drawn = dom.stdout.split('data-drawn="', 1)[1].split('"', 1)[0]
    points = int(drawn.split(",")[0].split(":")[1])
    slices = int(drawn.split(",")[1].split(":")[1])
    assert points > 10 and slices > 10, drawn
    console_errors = [line for line in dom.stderr.splitlines()
                      if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]
    assert not console_errors, console_errors
    shot = os.path.join(work, "page.png")
    subprocess.run([browser, *flags, "--window-size=1160,760", f"--screenshot={shot}", "file://" + page],
                   capture_output=True, timeout=120, check=True)
    width, height, rows = png_pixels(shot)
    # The memory plot (its canvas's area of the page): the reserved line's red
    # and the allocated line's blue are drawn there.
    plot = [px for row in rows[110:420] for px in row[20:1120]]
    reserved = sum(1 for px in plot if px == (0xd6, 0x27, 0x28))
    in_flight = sum(1 for px in plot if px == (0xff, 0x7f, 0x0e))
    assert reserved > 200 and in_flight > 200, f"the memory plot is not drawn: {reserved} red, {in_flight} orange pixels"
    print(f"trace view: {drawn}, {reserved} reserved and {in_flight} in-flight pixels in the plot")
    # A stack (any text a binding attaches) that would end the page's data
    # <script> early, or with "<!--" keep it from ending, stays data: the page
    # still draws and runs nothing of it.
    with open(os.path.join(HERE, "data", "pool_reuse.trace.json")) as f:
        hostile = json.load(f)
    attack = "</script><script>document.body.dataset.error='injected'</script><!--"
    for e in hostile["traceEvents"]:
        if e.get("ph") == "i":
            e.setdefault("args", {})["stack"] = attack
    hostile_path = os.path.join(work, "hostile.trace.json")
    with open(hostile_path, "w") as f:
        json.dump(hostile, f)
    hostile_page = os.path.join(work, "hostile.html")
    run(cli, "trace", "view", hostile_path, "-o", hostile_page)
    with open(hostile_page) as f:
        data = f.read().split('type="application/json">', 1)[1].split("</script>", 1)[0]
    assert "<" not in data and "'injected'" in data, "the data script holds a '<'"
    dom = subprocess.run([browser, *flags, "--dump-dom", "file://" + hostile_page],
                         capture_output=True, text=True, timeout=120)
    assert "data-error=" not in dom.stdout and 'data-drawn="memory:' in dom.stdout, dom.stdout[-2000:]


def replay(cli, work):
    # Run beside the fixture, so the report's first line is the same anywhere.
    os.chdir(os.path.join(HERE, "data"))
    outputs = [run(cli, "trace", "replay", "pool_reuse.trace.json", "--device-memory", "3MiB").stdout
               for _ in range(2)]
    assert outputs[0] == outputs[1], "replay is not deterministic"
    expected = (
        "pool_reuse.trace.json: 4 allocations and 5 frees, replayed on a fake device of 3.00 MiB\n"
        "policy                  peak reserved  peak allocated  backend allocs  cache hits  out of memory\n"
        "no caching pool              3.00 MiB        3.00 MiB               4           0  no\n"
        "caching pool                 3.00 MiB        3.00 MiB               2           2  no\n"
        "caching pool, cap 0          3.00 MiB        3.00 MiB               2           2  no\n"
        "skipped: event 18: free of 1:1:9, not allocated in the replay\n")
    assert outputs[0] == expected, outputs[0]
    # --pool-cap adds a capped pool per size; the policy column widens to fit.
    capped = run(cli, "trace", "replay", "pool_reuse.trace.json", "--device-memory", "3MiB",
                 "--pool-cap", "1MiB", "--pool-cap", "512KiB").stdout.splitlines()
    assert capped[1].startswith("policy" + " " * 24 + "peak reserved"), capped[1]
    assert capped[5:7] == [
        "caching pool, cap 1.00 MiB         3.00 MiB        3.00 MiB               2           2  no",
        "caching pool, cap 512.00 KiB       3.00 MiB        3.00 MiB               2           2  no"], capped
    done = run(cli, "trace", "replay", "pool_reuse.trace.json", "--pool-cap", "lots", expect=2)
    assert "--pool-cap: 'lots' is not a size" in done.stderr, done.stderr
    # Absurd sizes, a live handle allocated again, a double free: each named by
    # its event, in the trace's order, and nothing crashes.
    absurd = run(cli, "trace", "replay", "absurd_sizes.trace.json").stdout.splitlines()
    # 2**64 - 1 bytes (odd: aligned to 1) and 2**63 are more than any device holds.
    assert absurd[2].endswith("           0  2, first event 0 (16384.00 PiB of 1:1:1)"), absurd[2]  # under its header
    assert [line.split(":", 2)[1] for line in absurd[5:]] == [" event 1", " event 2", " event 6", " event 8"], absurd
    assert absurd[5] == "skipped: event 1: allocate of 1:1:2 without a size in bytes", absurd[5]
    assert absurd[7:] == ["skipped: event 6: allocate of 1:1:5, which is live",
                          "skipped: event 8: free of 1:1:5, not allocated in the replay"], absurd
    # A device too small for the 3 MiB tensor: every policy runs out, named.
    small = json.loads(run(cli, "trace", "replay", "pool_reuse.trace.json", "--device-memory", "2MiB",
                           "--json", "-").stdout)
    for policy in small["policies"]:
        assert policy["out_of_memory"] == 1 and "event 16" in policy["first_out_of_memory"], policy
    # Sizes 256 does not divide (a stream of 100-byte chunks) replay as they were, not skipped.
    odd_trace = os.path.join(work, "small-chunks.trace.json")
    run(cli, "stream", "--backend", "host", "--bytes", "4000", "--chunk", "100", "-q", "--trace", odd_trace)
    small_chunks = json.loads(run(cli, "trace", "replay", odd_trace, "--json", "-").stdout)
    assert not small_chunks["skipped"], small_chunks["skipped"]
    assert all(p["peak_allocated_bytes"] > 0 for p in small_chunks["policies"]), small_chunks
    # A recorded event is named by its place and its seq (what the page and the snapshot show): the free
    # of an allocate the ring dropped, here taken out by hand.
    with open(odd_trace) as f:
        recorded = json.load(f)
    events = recorded["traceEvents"]
    first = next(i for i, e in enumerate(events) if e.get("name") == "allocate")
    handle = events[first]["args"]["handle"]
    del events[first]
    free_at, free = next((i, e) for i, e in enumerate(events)
                         if e.get("name") == "free" and e["args"]["handle"] == handle)
    dropped_trace = os.path.join(work, "dropped-allocate.trace.json")
    with open(dropped_trace, "w") as f:
        json.dump(recorded, f)
    dropped = json.loads(run(cli, "trace", "replay", dropped_trace, "--json", "-").stdout)
    assert dropped["skipped"] == [f"event {free_at}, seq {free['args']['seq']}: free of {handle}, "
                                  "not allocated in the replay"], dropped["skipped"]
    # A real trace replays too, with the pool the stream ran with.
    trace = stream_trace(cli, work)
    real = json.loads(run(cli, "trace", "replay", trace, "--json", "-").stdout)
    assert real["allocations"] > 0 and real["allocations"] == real["frees"], real
    assert all(p["out_of_memory"] == 0 and p["peak_allocated_bytes"] > 0 for p in real["policies"]), real


def refusals(cli, work):
    def refused(name, text, words):
        path = os.path.join(work, name)
        with open(path, "w") as f:
            f.write(text)
        for command in (["trace", "replay", path], ["trace", "view", path, "-o", os.path.join(work, "x.html")]):
            done = run(cli, *command, expect=1)
            assert path in done.stderr and words in done.stderr, done.stderr
    refused("not-json.json", "{not json", "is not JSON")
    refused("other.json", json.dumps({"traceEvents": []}), "is not a devbridge trace")
    refused("newer.json", json.dumps({"otherData": {"format": "devbridge-trace", "version": 99},
                                      "traceEvents": []}), "version 99")
    refused("no-events.json", json.dumps({"otherData": {"format": "devbridge-trace", "version": 1}}),
            "no traceEvents")
    header = '{"otherData": {"format": "devbridge-trace", "version": 1}, "traceEvents": '
    # Nesting the page's writer would recurse through: refused, not a crash.
    refused("deep.json", header + "[" * 100000 + "]" * 100000 + "}", "nests deeper than 64 levels")
    refused("deep-args.json", header + '[{"ph": "i", "ts": 1, "args": ' + '{"a": ' * 100000 + "1" + "}" * 100001 +
            "]}", "nests deeper than 64 levels")
    refused("huge-number.json", header + '[{"ph": "i", "ts": 1' + "0" * 400 + "}]}", "is not JSON")
    # Events of the wrong shape, named by their index (the page would read them as it draws).
    for name, event, words in [("not-object", "5", "event 1 is not an object"),
                               ("no-ph", '{"ts": 1}', 'event 1 has no "ph" string'),
                               ("ph-number", '{"ph": 5, "ts": 1}', 'event 1 has no "ph" string'),
                               ("name-number", '{"ph": "B", "name": 3, "ts": 1}', 'event 1 has no "name" string'),
                               # The page labels every event by its name (a slice without one crashed it).
                               ("no-name", '{"ph": "B", "ts": 1}', 'event 1 has no "name" string'),
                               ("ts-string", '{"ph": "i", "name": "free", "ts": "1"}', '"ts" that is not a number'),
                               ("no-ts", '{"ph": "i", "name": "free"}', 'event 1 has no "ts"'),
                               ("args-list", '{"ph": "i", "name": "free", "ts": 1, "args": []}',
                                '"args" that are not an object'),
                               ("thread-name", '{"ph": "M", "name": "thread_name", "tid": 7}', "args.name"),
                               ("counter", '{"ph": "C", "name": "memory", "ts": 1, "args": {"allocated": "x"}}',
                                '"allocated" is not a number')]:
        refused(name + ".json", header + '[{"ph": "M", "name": "process_name", "args": {"name": "x"}}, ' + event +
                "]}", words)
    for command in (["trace", "replay", work], ["trace", "view", work, "-o", os.path.join(work, "x.html")]):
        done = run(cli, *command, expect=1)
        assert work in done.stderr and "is a directory" in done.stderr, done.stderr
    done = run(cli, "trace", "replay", os.path.join(work, "absent.json"), expect=1)
    assert "cannot be opened: No such file or directory" in done.stderr, done.stderr
    # Files the commands write, checked before anything runs (usage errors, exit 2), naming the reason.
    missing = os.path.join(work, "no-such-dir", "out")
    trace = os.path.join(work, "small.trace.json")
    with open(trace, "w") as f:
        f.write(header + "[]}")
    done = run(cli, "trace", "view", trace, "-o", missing + ".html", expect=2)
    assert "-o: cannot write" in done.stderr and "No such file or directory" in done.stderr, done.stderr
    for target in (missing + ".json", work, "-"):
        done = run(cli, "stream", "--backend", "fake", "--bytes", "64KiB", "--chunk", "4KiB", "-q", "--trace", target,
                   expect=2)
        assert "--trace: cannot write" in done.stderr and "chunks" not in done.stdout, (done.stdout, done.stderr)
    done = run(cli, "trace", "replay", trace, "--device-memory", "60KiB", expect=2)
    assert "--device-memory: 60.00 KiB is less than" in done.stderr, done.stderr
    # A report naming a file whose name is not UTF-8 is written, the bytes replaced.
    odd = os.fsdecode(os.path.join(os.fsencode(work), b"tr\xff.json"))
    with open(odd, "w") as f:
        f.write(header + "[]}")
    report = os.path.join(work, "report.json")
    done = subprocess.run([cli, "trace", "replay", odd, "--json", report], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with open(report) as f:
        assert json.load(f)["path"].endswith("tr\ufffd.json")
    done = run(cli, "trace", "frobnicate", expect=2)
    assert "trace commands: view, replay" in done.stderr, done.stderr


def large(cli, work):
    sys.path.insert(0, HERE)
    import make_large_trace
    path = os.path.join(work, "large.trace.json")
    trace = make_large_trace.synthetic_trace(100000)
    with open(path, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    validate(trace)
    page = os.path.join(work, "large.html")
    run(cli, "trace", "view", path, "-o", page)
    # The page is the trace once plus the template: nothing per event is added.
    overhead = os.path.getsize(page) - os.path.getsize(path)
    assert 0 < overhead < 64 * 1024, f"the page adds {overhead} bytes to the trace"
    outputs = [run(cli, "trace", "replay", path, "--pool-cap", "4MiB", "--json", "-").stdout for _ in range(2)]
    assert outputs[0] == outputs[1], "replay is not deterministic"
    report = json.loads(outputs[0])
    by_policy = {p["policy"]: p for p in report["policies"]}
    # Each policy keeps less than the one before it, so it goes to the backend more often.
    allocs = [by_policy[name]["backend_allocations"] for name in
              ("caching pool", "caching pool, cap 4.00 MiB", "caching pool, cap 0", "no caching pool")]
    assert allocs == sorted(allocs) and len(set(allocs)) == 4, by_policy
    memory = [e for e in trace["traceEvents"] if e.get("cat") == "memory"]
    assert report["allocations"] == sum(e["name"] == "allocate" for e in memory), report
    assert report["frees"] == sum(e["name"] == "free" for e in memory) and not report["skipped"], report
    browser = chromium()
    if browser is None:
        print("trace large: no chromium here (scripts/setup.sh installs Debian's); skipped")
        sys.exit(SKIP)
    dom = subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu",
                          f"--user-data-dir={os.path.join(work, 'profile')}", "--enable-logging=stderr", "--v=0",
                          "--dump-dom", "file://" + page], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr
    assert "data-error=" not in dom.stdout, dom.stdout[-2000:]
    drawn = dom.stdout.split('data-drawn="', 1)[1].split('"', 1)[0]
    slices = sum(e["ph"] == "B" for e in trace["traceEvents"])
    assert drawn.startswith("memory:") and drawn.endswith(f",slices:{slices}"), drawn
    # Downsampled: at most one point per pixel column of the 1100-pixel plot, per line.
    assert 0 < int(drawn.split(",")[0].split(":")[1]) <= 5 * 1100, drawn
    print(f"trace large: {len(trace['traceEvents'])} events, {drawn}")


def main():
    cli, case, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    {"stream_trace": stream_trace, "view": view, "replay": replay, "refusals": refusals,
     "large": large}[case](cli, work)
    print(f"trace {case}: ok")


if __name__ == "__main__":
    main()
