// Devices through the registry (options, enumeration) and the dtypes a
// device holds, enforced by the bridge (UnsupportedDType), on the backends
// every machine runs: fake and host.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "devbridge/backends.hpp"
#include "devbridge/backends/fake.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/consumer_names.hpp"
#include "support.hpp"

namespace devbridge {
namespace {

using ::testing::HasSubstr;
using testing::expect_error;

// A fake device that holds only float32 and uint8.
std::unique_ptr<Backend> narrow_fake() { return make_backend("fake", {{"dtypes", "float32,uint8"}}); }

TEST(Devices, EveryAvailableBackendListsDevicesItsDeviceOptionBindsAgain) {
  for (const auto& backend : list_backends()) {
    if (!backend.available) continue;
    const auto devices = list_devices(backend.name);
    ASSERT_FALSE(devices.empty()) << backend.name;
    for (const auto& device : devices) {
      EXPECT_EQ(device.name, backend.name);
      EXPECT_FALSE(device.device_id.empty()) << backend.name;
      EXPECT_FALSE(device.dtypes.empty()) << backend.name;
      EXPECT_EQ(make_backend(backend.name, {{"device", device.device_id}})->describe().device_id, device.device_id);
    }
  }
  EXPECT_THAT(expect_error(ErrorKind::Unavailable, [] { list_devices("tpu"); }),
              HasSubstr("unknown backend 'tpu' (this build has: "));
}

TEST(Devices, AutoListsTheDevicesOfTheBackendItOpens) {
  const std::string opened = make_backend("auto")->describe().name;
  const auto devices = list_devices("auto");
  ASSERT_FALSE(devices.empty());
  for (const auto& device : devices) EXPECT_EQ(device.name, opened);
  EXPECT_EQ(devices.size(), list_devices(opened).size());
}

TEST(Devices, EveryBackendThatCannotRunSaysWhyAndWhatToInstallInOneLine) {
  for (const auto& backend : list_backends()) {
    const std::string line = describe_availability(backend);
    EXPECT_EQ(line.find('\n'), std::string::npos) << line;
    if (backend.available) {
      EXPECT_EQ(line, "available");
      EXPECT_TRUE(backend.remedy.empty()) << backend.name;
    } else {
      EXPECT_FALSE(backend.reason.empty()) << backend.name;
      EXPECT_FALSE(backend.remedy.empty()) << backend.name << ": " << line;
      EXPECT_THAT(line, HasSubstr(backend.reason));
      EXPECT_THAT(line, HasSubstr("; to use it: " + backend.remedy));
    }
  }
  EXPECT_EQ(describe_availability({"cuda", false, false, "configured with -DDEVBRIDGE_WITH_CUDA=OFF", "rebuild"}),
            "not built: configured with -DDEVBRIDGE_WITH_CUDA=OFF; to use it: rebuild");
  EXPECT_EQ(describe_availability({"opencl", true, false, "OpenCL: no platform", ""}), "unavailable: OpenCL: no platform");
}

TEST(Devices, OptionsABackendDoesNotTakeAreRefusedNamingWhatItTakes) {
  const auto unknown = expect_error(ErrorKind::Unsupported, [] { make_backend("host", {{"context", "1"}}); });
  EXPECT_THAT(unknown, HasSubstr("backend host has no option 'context'"));
  EXPECT_THAT(unknown, HasSubstr("inline_async_max_bytes"));
  EXPECT_THAT(expect_error(ErrorKind::Unavailable, [] { make_backend("fake", {{"device", "1"}}); }),
              HasSubstr("option device='1': no such device; this backend has one device"));
  for (const char* bad : {"-1", "", " 5", "18446744073709551616", "12kb", "+3", "0x", "0x-1", "0x 5", "08a", "0b101"})
    EXPECT_THAT(expect_error(ErrorKind::Unsupported, [&] { make_backend("fake", {{"memory_bytes", bad}}); }),
                HasSubstr("not a non-negative integer")) << bad;
  EXPECT_THAT(expect_error(ErrorKind::Unsupported, [] { make_backend("fake", {{"dtypes", "float32,float33"}}); }),
              HasSubstr("'float33' is not a dtype name"));
  EXPECT_EQ(make_backend("fake", {{"memory_bytes", "0x1000"}})->describe().total_memory, 4096u);
  EXPECT_EQ(make_backend("fake", {{"memory_bytes", "0X1F"}})->describe().total_memory, 31u);
  // A leading 0 is decimal, not octal: "0100000" is a hundred thousand bytes, "08" eight.
  EXPECT_EQ(make_backend("fake", {{"memory_bytes", "0100000"}})->describe().total_memory, 100000u);
  EXPECT_EQ(make_backend("fake", {{"memory_bytes", "08"}})->describe().total_memory, 8u);
}

TEST(Devices, ABridgeRefusesAnAllocationOfADTypeItsDeviceDoesNotHold) {
  auto backend = narrow_fake();
  fake::FakeBackend* fake = backend->test_controls()->fake();
  Bridge bridge(std::move(backend), BridgeOptions{});
  const auto refused =
      expect_error(ErrorKind::UnsupportedDType, [&] { bridge.alloc_device(ObjectSpec{1024, 4, DType::Float64}, 1024); });
  EXPECT_THAT(refused, HasSubstr("an allocation of dtype float64: the bridge's fake device 0"));
  EXPECT_THAT(refused, HasSubstr("it holds: uint8, float32"));
  EXPECT_EQ(fake->live_allocations(), 0u);
  // What it holds, and untyped bytes, still go.
  bridge.free_device(bridge.alloc_device(ObjectSpec{1024, 4, DType::Float32}, 1024));
  bridge.free_device(bridge.alloc_device(ObjectSpec{1024, 4, std::nullopt}, 1024));
}

TEST(Devices, AViewOfUntypedBytesTakesOnlyADTypeTheDeviceHolds) {
  Bridge bridge(narrow_fake(), BridgeOptions{});
  const auto bytes = bridge.alloc_device(ObjectSpec{1024, 8, std::nullopt}, 1024);
  EXPECT_THAT(expect_error(ErrorKind::UnsupportedDType,
                           [&] { bridge.view(bytes, ViewSpec{DType::Int64, {4}, {}, 0}); }),
              HasSubstr("a view of dtype int64"));
  { auto lease = bridge.view(bytes, ViewSpec{DType::Float32, {4}, {}, 0}); }
  // A typed allocation still says the dtype differs, whatever the device holds.
  const auto typed = bridge.alloc_device(ObjectSpec{1024, 4, DType::Float32}, 1024);
  expect_error(ErrorKind::InvalidViewDType, [&] { bridge.view(typed, ViewSpec{DType::Int64, {4}, {}, 0}); });
  bridge.free_device(typed);
  bridge.free_device(bytes);
}

// Optional capabilities answer Unsupported where a backend lacks them, so
// callers ask instead of naming a backend.
TEST(Devices, ConsumersNameADeviceByItsKindAndOrdinal) {
  EXPECT_EQ(tinygrad_device(DeviceKind::Cpu, 0), "CPU");
  EXPECT_EQ(tinygrad_device(DeviceKind::Cuda, 0), "CUDA:0");
  EXPECT_EQ(tinygrad_device(DeviceKind::Cuda, 3), "CUDA:3");
  EXPECT_EQ(tinygrad_device(DeviceKind::OpenCL, 0), "CL");
  EXPECT_EQ(tinygrad_device(DeviceKind::OpenCL, 2), "CL:2");
  EXPECT_EQ(dlpack_device(DeviceKind::Cpu), DLPackDevice::CPU);
  EXPECT_EQ(dlpack_device(DeviceKind::Cuda), DLPackDevice::CUDA);
  EXPECT_EQ(dlpack_device(DeviceKind::OpenCL), DLPackDevice::OpenCL);
  EXPECT_EQ(dlpack_device_name(DLPackDevice::CPU), "cpu");
  EXPECT_EQ(dlpack_device_name(DLPackDevice::CUDA), "cuda");
  EXPECT_EQ(dlpack_device_name(DLPackDevice::CUDAHost), "cuda_host");
  EXPECT_EQ(dlpack_device_name(DLPackDevice::OpenCL), "opencl");
}

TEST(Capabilities, ABackendWithoutOneAnswersUnsupported) {
  auto host = make_backend("host");
  EXPECT_EQ(host->describe().native_context, 0u) << "no native context";
  EXPECT_THAT(expect_error(ErrorKind::Unsupported, [&] { host->order_consumer_queue(1); }),
              HasSubstr("no consumer queues"));
  // Test controls: one accessor; what a backend does not keep is empty.
  ASSERT_NE(host->test_controls(), nullptr);
  EXPECT_EQ(host->test_controls()->live_allocations(), 0u);
  EXPECT_TRUE(host->test_controls()->can_hold_copies());
  host->test_controls()->hold_copies(true);
  host->test_controls()->hold_copies(false);
  EXPECT_FALSE(host->test_controls()->live_fences().has_value());
  EXPECT_EQ(host->test_controls()->fake(), nullptr);
  auto fake = make_backend("fake");
  ASSERT_NE(fake->test_controls(), nullptr);
  EXPECT_EQ(fake->test_controls()->live_allocations(), 0u);
  EXPECT_EQ(fake->test_controls()->fake(), fake.get());
}

}  // namespace
}  // namespace devbridge
