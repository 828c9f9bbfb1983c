#!/usr/bin/env python3
"""Writes the fuzzer's seed corpus (tests/fuzz/corpus/): short, meaningful
operation sequences in the target's input format (3 configuration bytes, then
9 bytes per operation: a kind and eight parameters; see tests/model/harness.hpp).

Run from anywhere: python3 tests/fuzz/make_corpus.py. Deterministic. Seeds
named regression-* (triaged findings, tests/fuzz/open-findings/README.md) are
kept as they are."""
import os
import random

OPS = ["alloc", "free", "release", "extent", "reserve", "release_host", "write_ring", "read_ring",
       "h2d", "d2h", "complete", "complete_all", "poll", "copy_status", "wait", "safe_to_release",
       "begin_step", "end_step", "axpy", "view", "end_view", "inject", "restart", "close",
       "read_device", "report_completion", "lease_host", "end_host_lease", "hold_launches", "end_view_after",
       "end_step_after", "block_queue", "signal_fence", "pitched_copy",
       "register_host", "unregister_host", "region_copy", "region_pitched_copy", "adopt_host", "region_bytes"]
K = {name: i for i, name in enumerate(OPS)}
# The kinds random_00..11 were drawn from when they were written (OPS up to
# signal_fence): kept, so those seeds stay as they are; random_regions_*
# draw from every kind.
OLD_RANDOM_KINDS = K["signal_fence"] + 1

# Inject combos (harness.hpp do_inject): parameter value -> (call, failure)
INJ = {"alloc_failed": 0, "h2d_submit": 1, "h2d_at_completion": 2, "h2d_lost": 3, "h2d_dup": 4, "h2d_late": 5,
       "d2h_submit": 6, "d2h_at_completion": 7, "d2h_lost": 8, "d2h_dup": 9, "d2h_late": 10, "view_invalid": 11,
       "quiesce_fatal": 12, "alloc_fatal": 35, "h2d_fatal": 36, "d2h_fatal": 37, "launch_fatal": 38,
       "view_fatal": 39}


def op(name, *p):
    p = list(p) + [0] * (8 - len(p))
    return bytes([K[name]] + [x & 0xFF for x in p])


# Building blocks (the parameters as harness.hpp interprets them).
# alloc: p0 dtype (11 = float32, 5 = uint8), p1 alignment index (5 = 64),
# p2 extent multiplier, p3 bit 7 = x16, p4 2 = max_extent 2^64-1, p5 shape kind (3 = tensor, 1 = vector).
ALLOC_F32 = op("alloc", 11, 5, 15, 0, 2, 3)          # float32, 1024 bytes, tensor
ALLOC_U8 = op("alloc", 5, 5, 3, 0, 2, 1)             # uint8, 256 bytes, vector
RESERVE_256 = op("reserve", 6, 3, 0x80)               # 256 bytes, align 64
NEWEST = 11                                           # a range parameter: the newest reservation, exactly
WRITE = op("write_ring", NEWEST, 0, 63, 7)            # the newest range, whole
# copies: p0/p1 the newest live allocation, p2 = 3 its whole extent, p4 bit 0 async,
# p5 = 0 a live reservation that holds it, p7 = 0 no wait for room.
H2D_ASYNC = op("h2d", 0, 0, 3, 0, 1, 0, 0, 0)
H2D_SYNC = op("h2d", 0, 0, 3, 0, 0, 0, 0, 0)
D2H_ASYNC = op("d2h", 0, 0, 3, 0, 1, 0, 0, 0)
D2H_SYNC = op("d2h", 0, 0, 3, 0, 0, 0, 0, 0)
COMPLETE_OK = op("complete", 0, 1)
COMPLETE_FAIL = op("complete", 0, 0)
STATUS = op("copy_status", 0, 0)
WAIT0 = op("wait", 0, 0, 0)
READ_RING = op("read_ring", NEWEST, 0, 63)
READ_DEV = op("read_device", 0)
RELEASE_HOST = op("release_host", NEWEST, 0)


def inject(name, nth=1):
    return op("inject", INJ[name], nth - 1)


# Fences (harness.hpp): queue parameter q -> consumer queue 1 + q % 3; the
# last parameter of hold/block/signal, bit 0: stats() right after (it reaps),
# else the next operation's call is the first to notice.
def hold(on, stats=0):
    return op("hold_launches", 1 if on else 0, 0, stats)


def block(q, stats=0):
    return op("block_queue", 1, q, stats)


def unblock(q, stats=0):
    return op("block_queue", 0, q, stats)


def view_after(lease, q):
    return op("end_view_after", lease, q)


VIEW = op("view", 0, 0, 1, 0, 0, 0, 0, 0)            # a whole view of the newest live allocation
END_VIEW = op("end_view", 0)
AXPY = op("axpy", 0, 0, 0, 1, 3, 0, 0, 1)             # x = newest, y = the one before, whole extents
AXPY_SELF = op("axpy", 0, 0, 0, 0, 3, 0, 1, 1)        # x == y


# Registered host memory (harness.hpp do_register, do_copy, do_adopt):
# register_host p0 a span of the harness's arena (0-3 a page, 4-5 two pages,
# 6-11 half pages, 12 one aligned to 32 bytes only; 13 empty, 14 inside the
# ring, 15 past the address space), p1 bit 0 read-only, bit 1 fresh bytes
# (while no region holds them), p2 % 32: 31 an injected refusal, 30 a fatal
# one, p3 the bytes' seed.
def register(span, read_only=False, fresh=True, inject_=0, seed=0):
    return op("register_host", span, int(read_only) | 2 * int(fresh), inject_, seed)


# region copies: as h2d/d2h with p4 bit 1 the direction (download) and the
# host side a live region's range (registering a writable page first when
# none fits, p5 % 16 < 11; with p5 = 11 it registers nothing and picks any live region).
def region_copy(download=False, asynchronous=False, p5=0, p6=0):
    return op("region_copy", 0, 0, 3, 0, int(asynchronous) | 2 * int(download), p5, p6, 0)


# adopt_host: p0/p1 the region (a live read-only one first), p2 dtype, p3
# alignment index, p4 offset (0: none), p5 length (0: all the region holds),
# p6 max_extent (2: 2^64-1) and shape (p6 / 8 % 4), p7 / 8 % 4 != 0:
# register a read-only page first when none is live.
ADOPT_F32 = op("adopt_host", 0, 0, 11, 5, 0, 0, 2 + 8 * 3, 8)  # float32, align 64, the whole region, tensor
ADOPT_U8 = op("adopt_host", 0, 0, 5, 5, 0, 0, 2 + 8 * 1, 8)    # uint8, a vector


def region_bytes(write=False, seed=0, a=0, b=0):
    return op("region_bytes", a, b, int(write), seed)


def seq(*parts, cfg=(0, 0, 0)):
    return bytes(cfg) + b"".join(parts)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    out = os.path.join(here, "corpus")
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        if not f.startswith("regression-"):
            os.remove(os.path.join(out, f))
    seeds = {
        "upload_download_sync": seq(ALLOC_U8, RESERVE_256, WRITE, H2D_SYNC, RESERVE_256, D2H_SYNC, READ_RING, READ_DEV),
        "upload_async_complete": seq(ALLOC_U8, RESERVE_256, WRITE, H2D_ASYNC, STATUS, RELEASE_HOST,
                                     COMPLETE_OK, STATUS, op("safe_to_release", 0, 0), RELEASE_HOST, READ_DEV),
        "download_async_fail": seq(ALLOC_U8, RESERVE_256, D2H_ASYNC, COMPLETE_FAIL, STATUS, STATUS, WAIT0, READ_RING),
        "failed_log_evicts": seq(ALLOC_U8, RESERVE_256, H2D_ASYNC, COMPLETE_FAIL, H2D_ASYNC, COMPLETE_FAIL, H2D_ASYNC,
                                 COMPLETE_FAIL, op("copy_status", 0, 2), op("copy_status", 0, 1), cfg=(0, 0, 1)),
        "failed_log_limit_2": seq(ALLOC_U8, RESERVE_256, H2D_ASYNC, COMPLETE_FAIL, H2D_ASYNC, COMPLETE_OK, H2D_ASYNC,
                                  COMPLETE_FAIL, H2D_ASYNC, COMPLETE_FAIL, op("wait", 0, 3, 0), cfg=(0, 0, 2)),
        "restart_with_pending": seq(ALLOC_U8, RESERVE_256, WRITE, H2D_ASYNC, D2H_ASYNC, op("restart", 0), STATUS,
                                    RELEASE_HOST, op("free", 0, 0), op("copy_status", 31, 3)),
        "restart_quiesce_fatal": seq(ALLOC_U8, RESERVE_256, D2H_ASYNC, inject("quiesce_fatal"), op("restart", 0),
                                     RELEASE_HOST, op("poll"), op("restart", 0), RELEASE_HOST,
                                     RESERVE_256),
        "close_quiesce_fatal": seq(ALLOC_U8, RESERVE_256, H2D_ASYNC, inject("quiesce_fatal"), op("close"), op("poll"),
                                   op("close"), op("alloc", 5, 5, 3, 0, 2, 1)),
        "close_with_views_and_leases": seq(ALLOC_U8, op("view", 0, 0, 1, 0, 0, 0, 0, 0), RESERVE_256,
                                           op("lease_host", NEWEST, 0), op("close"), op("end_view", 0),
                                           op("end_host_lease", 0), cfg=(0, 0x80, 0)),
        "close_fails_then_view_ends": seq(ALLOC_U8, inject("quiesce_fatal"), op("view", 0, 0, 1, 0, 0, 0, 0, 0),
                                          op("release", 0, 0), op("close"), op("end_view", 0), op("close")),
        "late_completion_then_sync_query": seq(inject("d2h_late"), ALLOC_U8, D2H_ASYNC, op("restart", 0), ALLOC_U8,
                                               D2H_SYNC, op("safe_to_release", 0, 0), op("complete_all", 0, 1)),
        "restart_with_view": seq(ALLOC_F32, op("view", 0, 0, 1, 0, 0, 0, 0, 0), op("restart", 0),
                                 op("view", 0, 0, 1, 0, 0, 0, 0, 0), op("end_view", 0), op("free", 0, 0)),
        "restart_invalid_generations": seq(op("restart", 4), op("restart", 5), op("restart", 6), op("restart", 7),
                                           op("restart", 0), op("restart", 3)),
        "forged_events": seq(ALLOC_U8, RESERVE_256, H2D_SYNC, H2D_ASYNC, COMPLETE_OK, op("restart", 0),
                             *[op("copy_status", 7 + 8 * k, k) for k in range(8)],
                             *[op("safe_to_release", 7 + 8 * k, k) for k in range(8)]),
        "forged_handles": seq(ALLOC_U8, op("restart", 0), ALLOC_U8,
                              *[op("free", 7 + 8 * k, k) for k in range(8)],
                              *[op("extent", 7 + 8 * k, k) for k in range(8)]),
        "hostile_allocs": seq(*[op("alloc", k, k * 7, 200 + k, k * 31, k, k) for k in range(16)]),
        "hostile_reserves": seq(*[op("reserve", 0, k, k) for k in range(8)], op("reserve", 1, 0, 0), op("reserve", 2, 0, 0)),
        "hostile_ranges": seq(ALLOC_U8, RESERVE_256, *[op("h2d", 0, 0, k, k * 9, k & 1, 7, k) for k in range(16)]),
        "hostile_views": seq(ALLOC_F32, *[op("view", 0, 0, 1, 0, k, k, k, k) for k in range(24)]),
        "hostile_timeouts": seq(ALLOC_U8, RESERVE_256, H2D_ASYNC, *[op("wait", 0, 0, k) for k in range(8)],
                                COMPLETE_OK, *[op("wait", 0, 0, k) for k in range(8)]),
        "backpressure": seq(ALLOC_U8, RESERVE_256, H2D_ASYNC, H2D_ASYNC, op("h2d", 0, 0, 1, 0, 1, 0, 0, 2),
                            op("h2d", 0, 0, 1, 0, 1, 0, 0, 4), cfg=(0, 1, 0)),
        "steps_and_release": seq(ALLOC_U8, op("begin_step", 1, 1, 0, 0), op("begin_step", 1, 1, 0, 0),
                                 op("release", 0, 0), op("free", 0, 0), op("end_step", 1), op("end_step", 1)),
        "release_under_copy": seq(ALLOC_U8, RESERVE_256, H2D_ASYNC, op("free", 0, 0), op("release", 0, 0),
                                  op("free", 0, 0), COMPLETE_OK, op("extent", 0, 0)),
        "axpy": seq(ALLOC_F32, ALLOC_F32, op("reserve", 6, 15, 0x80), WRITE, H2D_SYNC,
                    op("axpy", 0, 0, 0, 1, 3, 0, 0, 1), op("axpy", 0, 0, 0, 1, 3, 0, 0, 3), READ_DEV,
                    op("read_device", 1)),
        "axpy_fatal": seq(ALLOC_F32, inject("launch_fatal"), op("axpy", 0, 0, 0, 0, 0, 0, 1, 0), op("poll"),
                          op("restart", 0), op("poll")),
        "lost_dup_late": seq(ALLOC_U8, RESERVE_256, inject("h2d_lost"), H2D_ASYNC, COMPLETE_OK, inject("h2d_dup"),
                             H2D_ASYNC, COMPLETE_OK, inject("d2h_late"), D2H_ASYNC, op("restart", 0), ALLOC_U8,
                             H2D_SYNC, op("poll")),
        "submit_failures": seq(ALLOC_U8, RESERVE_256, inject("h2d_submit"), H2D_ASYNC, inject("d2h_at_completion"),
                               D2H_SYNC, inject("h2d_at_completion"), H2D_ASYNC, COMPLETE_OK, STATUS),
        "fatal_copy_then_restart": seq(ALLOC_U8, RESERVE_256, inject("d2h_fatal"), D2H_ASYNC, op("poll"),
                                       RELEASE_HOST, op("restart", 0), op("poll")),
        "view_faults": seq(ALLOC_U8, inject("view_invalid"), op("view", 0, 0, 1, 0, 0, 0, 0, 0), inject("view_fatal"),
                           op("view", 0, 0, 1, 0, 0, 0, 0, 0), op("view", 0, 0, 1, 0, 0, 0, 0, 0)),
        "alloc_faults": seq(inject("alloc_failed"), ALLOC_U8, inject("alloc_fatal", 2), ALLOC_U8, ALLOC_U8, ALLOC_U8,
                            op("restart", 0), ALLOC_U8),
        "forged_completion": seq(ALLOC_U8, RESERVE_256, WRITE, H2D_ASYNC, op("report_completion", 0, 0, 1),
                                 RELEASE_HOST, COMPLETE_OK, op("report_completion", 7, 3, 0)),
        "ring_zero": seq(ALLOC_U8, cfg=(6, 0, 0)),
        "ring_wraps_2_64": seq(ALLOC_U8, cfg=(7, 0, 0)),
        "ring_wraps_2_64_minus_4095": seq(ALLOC_U8, cfg=(0x87, 0, 0)),
        "failed_limit_zero": seq(ALLOC_U8, cfg=(0, 0, 5)),
        "ring_wrap_around": seq(*[RESERVE_256 for _ in range(6)], op("release_host", NEWEST, 5),
                                op("release_host", NEWEST, 4), RESERVE_256, op("reserve", 1, 0, 0), cfg=(2, 0, 0)),
        # Fences: a held launch holds x and y (free refused, release deferred)
        # until the hold lifts; the next call into the bridge frees.
        "fence_held_launch": seq(ALLOC_F32, ALLOC_F32, hold(True), AXPY, op("free", 0, 0), op("release", 0, 1),
                                 op("free", 0, 0), hold(False), op("free", 0, 0), ALLOC_F32, hold(True), AXPY_SELF,
                                 op("release", 0, 0), hold(False), RELEASE_HOST, op("poll")),
        "fence_view_after_queue": seq(ALLOC_F32, VIEW, VIEW, block(0), view_after(0, 0), op("free", 0, 0),
                                      op("release", 0, 0), op("end_view", 0), unblock(0), op("read_ring", NEWEST, 0, 63),
                                      op("lease_host", 15, 0), op("extent", 0, 0)),
        "fence_step_after_queue": seq(ALLOC_F32, ALLOC_U8, op("begin_step", 1, 2, 0, 0, 0, 1), block(1),
                                      op("end_step_after", 1, 1), op("free", 0, 0), op("release", 0, 1), unblock(1, 1),
                                      op("free", 0, 0), op("begin_step", 2, 1, 0, 0), op("end_step_after", 2, 2),
                                      op("free", 0, 0)),
        "fence_out_of_order": seq(ALLOC_F32, VIEW, ALLOC_F32, VIEW, block(0), view_after(1, 0), view_after(0, 0),
                                  op("release", 0, 0), op("release", 0, 1), op("signal_fence", 0, 1), op("poll"),
                                  op("signal_fence", 0, 0), op("poll"), op("signal_fence", 7, 3)),
        "fence_restart_orphans": seq(ALLOC_F32, VIEW, ALLOC_F32, block(2), view_after(0, 2), hold(True), AXPY,
                                     op("restart", 0), unblock(2), op("end_view", 0), op("poll"), op("restart", 0)),
        "fence_close_abandons": seq(ALLOC_F32, VIEW, VIEW, ALLOC_U8, op("begin_step", 1, 1, 0, 0), block(0), block(1),
                                    view_after(0, 0), op("end_step_after", 1, 1), op("close"), unblock(1),
                                    view_after(0, 0), op("poll")),
        "fence_close_fails_then_reap": seq(ALLOC_F32, VIEW, VIEW, block(0), view_after(0, 0), op("release", 0, 0),
                                           inject("quiesce_fatal"), op("close"), unblock(0), op("end_view", 0),
                                           op("close")),
        "fence_leases_outlive_end_after": seq(ALLOC_F32, VIEW, ALLOC_U8, VIEW, block(0), block(1),
                                              op("lease_host", 15, 0), cfg=(0, 0x80 | (3 << 2), 0)),
        "fence_ends_after_close": seq(ALLOC_F32, VIEW, VIEW, block(1), op("close"), cfg=(0, 0x1f << 2, 0)),
    }
    seeds.update({
        # Copies to and from a registered page; unregistering waits for them.
        "region_copies": seq(ALLOC_U8, region_copy(), region_bytes(write=True, seed=9), region_copy(asynchronous=True),
                             op("unregister_host", 0, 0), COMPLETE_OK, region_copy(download=True, asynchronous=True),
                             COMPLETE_OK, region_bytes(), region_copy(download=True), READ_DEV,
                             op("unregister_host", 0, 0), region_copy(p5=11)),
        # A read-only region: uploads only; overlapping and hostile spans; forged regions.
        "region_read_only": seq(register(1, read_only=True), ALLOC_U8, region_copy(download=True, p5=11),
                                region_copy(p5=11), op("region_pitched_copy", 0, 0, 0, 4, 8, 4, 2, 0),
                                register(4), register(13), register(14), register(15),
                                *[op("unregister_host", 15 + 16 * k, k) for k in range(8)],
                                *[region_bytes(a=15 + 16 * k, b=k) for k in range(8)]),
        # An adopted float32 region: read in place (a view, a download, axpy's
        # x), refused as a write's target (an upload, axpy's y); its region
        # stays registered until the allocation goes.
        "adopt_read_only": seq(ADOPT_F32, VIEW, op("d2h", 0, 0, 0, 7, 0, 0, 0, 0), op("read_ring", NEWEST, 0, 7),
                               op("h2d", 0, 0, 0, 7, 0, 0, 0, 0), ALLOC_F32, op("axpy", 0, 0, 0, 1, 0, 1, 0, 1),
                               op("axpy", 0, 1, 0, 0, 0, 1, 0, 1),
                               READ_DEV, op("unregister_host", 0, 0), op("free", 0, 1), op("release", 0, 1), END_VIEW,
                               op("unregister_host", 0, 0)),
        # A view of an adopted allocation outlives the restart: its region is
        # retained (registering over it is refused) until the view ends.
        "adopt_retained_over_restart": seq(ADOPT_U8, VIEW, op("restart", 0), register(0), region_bytes(),
                                           END_VIEW, register(0, read_only=True), ADOPT_U8, VIEW, op("close"),
                                           region_bytes(a=11), END_VIEW),
        # The view ends after a blocked consumer queue: close abandons the
        # adoption, whose region stays registered for good.
        "adopt_abandoned_at_close": seq(ADOPT_F32, VIEW, VIEW, block(0), view_after(0, 0), op("close"), unblock(0)),
        "adopt_hostile": seq(register(1), op("adopt_host", 0, 0, 5, 5, 0, 0, 2, 0), register(12, read_only=True),
                             *[op("adopt_host", 0, 0, k, k, k * 9, k * 13, k, 8) for k in range(16)],
                             *[op("adopt_host", 15 + 16 * k, k, 5, 0, 0, 0, 2, 0) for k in range(8)]),
        # Injected refusals of a registration (the fatal one breaks the
        # bridge); a restart whose quiesce fails keeps every region.
        "region_faults": seq(register(0, inject_=31), register(1, inject_=30), register(1), op("restart", 0),
                             ALLOC_U8, register(1), region_copy(asynchronous=True), inject("quiesce_fatal"),
                             op("restart", 0), region_bytes(), op("unregister_host", 0, 0), op("restart", 0),
                             region_bytes(a=11)),
    })
    rng = random.Random(10)
    for k in range(12):  # random programs, for breadth
        n = rng.randrange(8, 60)
        body = b"".join(bytes([rng.randrange(OLD_RANDOM_KINDS)] + [rng.randrange(256) for _ in range(8)])
                        for _ in range(n))
        seeds["random_%02d" % k] = bytes([rng.randrange(256) for _ in range(3)]) + body
    rng = random.Random(11)
    for k in range(4):  # random programs that register and adopt host memory (half their operations)
        n = rng.randrange(16, 60)
        kinds = [rng.randrange(len(OPS)) if rng.random() < 0.5 else rng.randrange(K["register_host"], len(OPS))
                 for _ in range(n)]
        body = b"".join(bytes([kind] + [rng.randrange(256) for _ in range(8)]) for kind in kinds)
        seeds["random_regions_%02d" % k] = bytes([rng.randrange(256) for _ in range(3)]) + body
    for name, data in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print("wrote %d seeds to %s" % (len(seeds), out))


if __name__ == "__main__":
    main()
