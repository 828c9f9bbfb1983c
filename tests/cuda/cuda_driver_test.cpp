// The no-driver path: what probe(), the factory and the registry say when
// libcuda cannot be loaded or cannot initialise. Runs on every machine: the
// library path is pointed at a missing file (and at the toolkit's stub) with
// DEVBRIDGE_LIBCUDA, so the result does not depend on the machine.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "backends/cuda/cuda_driver.hpp"
#include "cuda_test_support.hpp"
#include "devbridge/backends.hpp"
#include "devbridge/backends/cuda.hpp"
#include "devbridge/backends/host.hpp"

namespace devbridge::cuda {
namespace {

using testing::kMissingDriver;
using testing::ScopedEnv;

TEST(CudaDriverLoad, MissingLibraryIsRecordedNotThrown) {
  const detail::Driver& driver = detail::load_driver(kMissingDriver);
  EXPECT_FALSE(driver.loaded());
  EXPECT_FALSE(driver.usable());
  EXPECT_NE(driver.load_error.find(kMissingDriver), std::string::npos) << driver.load_error;
  EXPECT_NE(driver.load_error.find("cannot open shared object file"), std::string::npos) << driver.load_error;
  EXPECT_EQ(driver.cuInit, nullptr);
}

TEST(CudaDriverLoad, SamePathGivesTheSameDriver) {
  EXPECT_EQ(&detail::load_driver(kMissingDriver), &detail::load_driver(kMissingDriver));
}

TEST(CudaDriverLoad, LibraryPathFollowsTheEnvironment) {
  {
    ScopedEnv env("DEVBRIDGE_LIBCUDA", kMissingDriver);
    EXPECT_EQ(detail::driver_library_path(), kMissingDriver);
  }
  {
    ScopedEnv env("DEVBRIDGE_LIBCUDA", "");
    EXPECT_EQ(detail::driver_library_path(), "libcuda.so.1");
  }
}

TEST(CudaProbe, MissingDriverIsUnavailableWithTheLoaderReason) {
  ScopedEnv env("DEVBRIDGE_LIBCUDA", kMissingDriver);
  const Probe probe = cuda::probe();
  EXPECT_FALSE(probe.available);
  EXPECT_EQ(probe.device_count, 0);
  EXPECT_EQ(probe.reason.rfind("no driver (", 0), 0u) << probe.reason;
  EXPECT_NE(probe.reason.find("cannot open shared object file"), std::string::npos) << probe.reason;
  EXPECT_NE(probe.reason.find(kMissingDriver), std::string::npos) << "names the library it tried: " << probe.reason;
  EXPECT_EQ(probe.remedy.rfind("install the NVIDIA driver", 0), 0u) << probe.remedy;
  EXPECT_NE(probe.remedy.find("DEVBRIDGE_LIBCUDA"), std::string::npos) << probe.remedy;
}

TEST(CudaProbe, FactoryThrowsUnavailableNamingTheReason) {
  ScopedEnv env("DEVBRIDGE_LIBCUDA", kMissingDriver);
  const std::string reason = cuda::probe().reason;
  try {
    (void)make_cuda_backend();
    FAIL() << "make_cuda_backend succeeded without a driver";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::Unavailable);
    EXPECT_FALSE(error.fatal());
    EXPECT_NE(std::string(error.message()).find(reason), std::string::npos) << error.what();
  }
}

TEST(CudaProbe, RegistryListsCudaAsBuiltButUnavailable) {
  ScopedEnv env("DEVBRIDGE_LIBCUDA", kMissingDriver);
  const auto backends = list_backends();
  const auto row = std::find_if(backends.begin(), backends.end(), [](const auto& b) { return b.name == "cuda"; });
  ASSERT_NE(row, backends.end());
  EXPECT_TRUE(row->built);
  EXPECT_FALSE(row->available);
  EXPECT_NE(row->reason.find("no driver"), std::string::npos) << row->reason;
  EXPECT_EQ(row->remedy, cuda::probe().remedy);

  try {
    (void)make_backend("cuda");
    FAIL() << "make_backend(\"cuda\") succeeded without a driver";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::Unavailable);
    EXPECT_NE(std::string(error.what()).find("no driver"), std::string::npos) << error.what();
  }
  // "auto" falls back to a backend that runs here.
  auto fallback = make_backend("auto");
  ASSERT_NE(fallback, nullptr);
  EXPECT_FALSE(is_cuda_backend(*fallback));
}

TEST(CudaProbe, StubLibraryIsUnavailableBecauseCuInitFails) {
#ifndef DEVBRIDGE_TEST_CUDA_STUB
  GTEST_SKIP() << "the CUDA toolkit's stub libcuda.so was not found at configure time";
#else
  // The stub's soname is libcuda.so.1: once it is loaded, a later
  // dlopen("libcuda.so.1") in this process would return the stub. So bind
  // the default name first (to the real driver, or to its absence), and
  // leave machines with a working driver alone.
  if (detail::load_driver("libcuda.so.1").usable())
    GTEST_SKIP() << "a working driver is loaded; the stub case is for machines without one";
  ScopedEnv env("DEVBRIDGE_LIBCUDA", DEVBRIDGE_TEST_CUDA_STUB);
  const detail::Driver& driver = detail::load_driver(DEVBRIDGE_TEST_CUDA_STUB);
  ASSERT_TRUE(driver.loaded()) << driver.load_error;
  const Probe probe = cuda::probe();
  EXPECT_FALSE(probe.available);
  EXPECT_EQ(probe.reason, "cuInit failed: CUDA_ERROR_STUB_LIBRARY");
  EXPECT_NE(probe.remedy.find("the CUDA toolkit's stub"), std::string::npos) << probe.remedy;
  EXPECT_NE(probe.remedy.find("install the NVIDIA driver"), std::string::npos) << probe.remedy;
  try {
    (void)make_cuda_backend();
    FAIL() << "make_cuda_backend succeeded on the stub library";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::Unavailable);
    EXPECT_NE(std::string(error.what()).find("CUDA_ERROR_STUB_LIBRARY"), std::string::npos) << error.what();
  }
#endif
}

// On this machine, as it is: either CUDA runs (then the device tests cover
// it) or the probe says why not and the factory refuses with that reason.
TEST(CudaProbe, ThisMachineEitherRunsCudaOrSaysWhyNot) {
  const Probe probe = cuda::probe();
  if (probe.available) {
    EXPECT_GT(probe.device_count, 0);
    GTEST_SKIP() << "a CUDA device is present (" << probe.device_count << "); the device tests cover it";
  }
  EXPECT_FALSE(probe.reason.empty());
  try {
    (void)make_cuda_backend();
    FAIL() << "make_cuda_backend succeeded although probe said: " << probe.reason;
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::Unavailable);
    EXPECT_NE(std::string(error.what()).find(probe.reason), std::string::npos) << error.what();
  }
}

TEST(CudaHooks, RefuseABackendThatIsNotCuda) {
  auto host_backend = host::make_host_backend();
  EXPECT_FALSE(is_cuda_backend(*host_backend));
  for (auto call : {+[](Backend& b) { (void)context_of(b); },
                    +[](Backend& b) { order_stream_after_submitted_work(b, 1); }}) {
    try {
      call(*host_backend);
      ADD_FAILURE() << "a CUDA hook accepted the host backend";
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::Unsupported);
    }
  }
}

}  // namespace
}  // namespace devbridge::cuda
