// The OpenCL row's consumer queue: an in-order command queue of the test's
// own on the bridge's context (as pyopencl or tinygrad would make one from
// describe().native_context), blocked by a marker that waits on a user event.
//
// It calls OpenCL through the same run-time loaded ICD loader as the backend
// (the library links nothing from OpenCL), which is the one a consumer's
// libOpenCL would reach too.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend_drivers.hpp"
#include "backends/opencl/opencl_api.hpp"

namespace devbridge::conformance {
namespace {

using namespace opencl::abi;  // OpenCL's names, as cl.h would give them

const opencl::detail::Api& cl() { return opencl::detail::api(); }

void check(cl_int result, const char* call) {
  if (result != CL_SUCCESS) throw std::runtime_error(std::string("test consumer queue: ") + call + " failed: cl_int " + std::to_string(result));
}

// The device of the backend's context: the only one, or (a context of
// several) the one describe().device_id ("<platform>:<device>") names.
cl_device_id device_of(Backend& backend, cl_context context) {
  cl_uint count = 0;
  check(cl().clGetContextInfo(context, CL_CONTEXT_NUM_DEVICES, sizeof count, &count, nullptr),
        "clGetContextInfo(CL_CONTEXT_NUM_DEVICES)");
  std::vector<cl_device_id> in_context(count);
  check(cl().clGetContextInfo(context, CL_CONTEXT_DEVICES, count * sizeof(cl_device_id), in_context.data(), nullptr),
        "clGetContextInfo(CL_CONTEXT_DEVICES)");
  if (count == 1) return in_context.front();

  const std::string id = backend.describe().device_id;
  unsigned platform_index = 0, device_index = 0;
  if (std::sscanf(id.c_str(), "%u:%u", &platform_index, &device_index) != 2)
    throw std::runtime_error("test consumer queue: device id '" + id + "' is not <platform>:<device>");
  cl_uint platform_count = 0;
  check(cl().clGetPlatformIDs(0, nullptr, &platform_count), "clGetPlatformIDs");
  std::vector<cl_platform_id> platforms(platform_count);
  check(cl().clGetPlatformIDs(platform_count, platforms.data(), nullptr), "clGetPlatformIDs");
  if (platform_index < platform_count) {
    cl_uint device_count = 0;
    check(cl().clGetDeviceIDs(platforms[platform_index], CL_DEVICE_TYPE_ALL, 0, nullptr, &device_count),
          "clGetDeviceIDs");
    std::vector<cl_device_id> devices(device_count);
    check(cl().clGetDeviceIDs(platforms[platform_index], CL_DEVICE_TYPE_ALL, device_count, devices.data(), nullptr),
          "clGetDeviceIDs");
    if (device_index < device_count)
      for (cl_device_id device : in_context)
        if (device == devices[device_index]) return device;
  }
  throw std::runtime_error("test consumer queue: device " + id + " is not in the backend's context");
}

class OpenCLConsumerQueue final : public TestConsumerQueue {
 public:
  explicit OpenCLConsumerQueue(Backend& backend) {
    context_ = reinterpret_cast<cl_context>(backend.describe().native_context);
    cl_int result = CL_SUCCESS;
    queue_ = cl().clCreateCommandQueue(context_, device_of(backend, context_), 0, &result);
    check(result, "clCreateCommandQueue");
  }

  ~OpenCLConsumerQueue() override {
    unblock();
    cl().clFinish(queue_);
    cl().clReleaseCommandQueue(queue_);
  }

  std::uintptr_t handle() const override { return reinterpret_cast<std::uintptr_t>(queue_); }

  // The queue is in order: everything enqueued after the marker waits for it,
  // and the marker waits for the user event.
  void block() override {
    if (gate_ != nullptr) return;
    cl_int result = CL_SUCCESS;
    cl_event gate = cl().clCreateUserEvent(context_, &result);
    check(result, "clCreateUserEvent");
    if (const cl_int marked = cl().clEnqueueMarkerWithWaitList(queue_, 1, &gate, nullptr); marked != CL_SUCCESS) {
      cl().clSetUserEventStatus(gate, CL_COMPLETE);
      cl().clReleaseEvent(gate);
      check(marked, "clEnqueueMarkerWithWaitList");
    }
    cl().clFlush(queue_);
    gate_ = gate;
  }

  void unblock() override {
    if (gate_ == nullptr) return;
    cl().clSetUserEventStatus(gate_, CL_COMPLETE);
    cl().clReleaseEvent(gate_);
    gate_ = nullptr;
    cl().clFlush(queue_);
  }

 private:
  cl_context context_ = nullptr;
  cl_command_queue queue_ = nullptr;
  cl_event gate_ = nullptr;  // set while blocked
};

}  // namespace

std::unique_ptr<TestConsumerQueue> make_opencl_consumer_queue(Backend& backend) {
  return std::make_unique<OpenCLConsumerQueue>(backend);
}

}  // namespace devbridge::conformance
