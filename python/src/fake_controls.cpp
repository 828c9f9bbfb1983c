// FakeControl: the fake backend's test controls, reached through
// Bridge(backend="fake").fake so that tests script faults and completions
// from Python.
#include <string>
#include <string_view>

#include <nanobind/nanobind.h>

#include "devbridge/backends/fake.hpp"
#include "arguments.hpp"
#include "bindings.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {
namespace {

template <typename Enum>
Enum parse_named(std::string_view name, int count, std::string_view (*namer)(Enum) noexcept, const char* what) {
  std::string known;
  for (int i = 0; i < count; ++i) {
    auto value = static_cast<Enum>(i);
    if (namer(value) == name) return value;
    if (!known.empty()) known += ", ";
    known += namer(value);
  }
  throw nb::value_error((std::string("unknown fake ") + what + " \"" + std::string(name) + "\"; known: " + known).c_str());
}

nb::dict recorded_call_dict(const fake::RecordedCall& call) {
  nb::dict d;
  d["call"] = std::string(fake::call_name(call.call));
  d["bytes"] = call.bytes;
  d["alignment"] = call.alignment;
  d["address"] = call.address;
  d["host_offset"] = call.host_offset;
  d["device_offset"] = call.device_offset;
  d["mode"] = call.mode == CopyMode::Async ? "async" : "sync";
  // A pitched copy's layout exactly as the backend got it; None for a plain one.
  d["layout"] = call.layout.pitched() ? nb::cast(call.layout) : nb::none();
  d["event"] = nb::cast(call.event);
  return d;
}

}  // namespace

void bind_fake_controls(nb::module_& m) {
  nb::class_<PyFake>(m, "FakeControl", "Test controls of the fake backend (Bridge(backend=\"fake\").fake).")
      .def(
          "inject",
          [](PyFake& f, const std::string& call, const std::string& failure, nb::handle nth_object) {
            auto c = parse_named<fake::Call>(call, fake::kCallCount, &fake::call_name, "call");
            auto k = parse_named<fake::Failure>(failure, static_cast<int>(fake::Failure::Fatal) + 1,
                                                &fake::failure_name, "failure");
            const int nth = args::integer<int>(nth_object, "nth");
            if (nth < 1) throw nb::value_error("nth counts from 1");
            f.backend().inject(c, k, nth);
          },
          "call"_a, "failure"_a, "nth"_a = 1, "Fail the nth next call of that kind, once.")
      .def(
          "complete", [](PyFake& f, CopyEvent event, bool ok) { return f.backend().complete(event, ok); }, "event"_a,
          "ok"_a = true, "Deliver a pending copy's outcome; False when the event is not pending.")
      .def(
          "complete_all", [](PyFake& f, bool ok) { return f.backend().complete_all(ok); }, "ok"_a = true)
      .def("pending", [](PyFake& f) { return f.backend().pending(); })
      .def(
          "hold_launches", [](PyFake& f, bool hold) { f.backend().hold_launches(hold); }, "hold"_a,
          "While held, a launch's fence stays pending (its kernel \"still runs\"); lifting the hold passes it.")
      .def(
          "block_queue",
          [](PyFake& f, nb::handle queue) { f.backend().block_consumer_queue(args::integer<std::uintptr_t>(queue, "queue")); },
          "queue"_a, "Fences recorded on this consumer queue stay pending until unblock_queue.")
      .def(
          "unblock_queue",
          [](PyFake& f, nb::handle queue) {
            f.backend().unblock_consumer_queue(args::integer<std::uintptr_t>(queue, "queue"));
          },
          "queue"_a, "Passes the queue's fences; later ones pass at once.")
      .def("live_fences", [](PyFake& f) { return f.backend().live_fences(); },
           "Fences handed to the bridge and not yet given back.")
      .def(
          "report_completion", [](PyFake& f, CopyEvent event, bool ok) { f.backend().report_completion(event, ok); },
          "event"_a, "ok"_a = true, "Deliver a completion for an event the backend never saw.")
      .def("calls",
           [](PyFake& f) {
             nb::list out;
             for (const fake::RecordedCall& call : f.backend().calls()) out.append(recorded_call_dict(call));
             return out;
           },
           "The calls made, oldest first, as dicts: at least the last 65,536; older ones are dropped and\n"
           "counted by dropped_calls(), so a long run's log stays bounded.")
      .def("dropped_calls", [](PyFake& f) { return f.backend().dropped_calls(); },
           "How many of the oldest calls calls() no longer holds.")
      .def("clear_calls", [](PyFake& f) { f.backend().clear_calls(); })
      .def("live_allocations", [](PyFake& f) { return f.backend().live_allocations(); })
      .def("live_host_blocks", [](PyFake& f) { return f.backend().live_host_blocks(); })
      .def("live_registrations", [](PyFake& f) { return f.backend().live_registrations(); },
           "Host memory registered with the backend (Bridge.register_host) and not yet unregistered.")
      .def(
          "set_auto_complete", [](PyFake& f, bool on) { f.backend().set_auto_complete(on); }, "on"_a);
}

}  // namespace devbridge::python
