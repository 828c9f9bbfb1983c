// The driver entry points only the tests call: a context of a test's own
// (cuda_test_support.hpp's OwnContext), typed once for the tests and the
// emulated driver that exports them.
#pragma once

#include "backends/cuda/cuda_driver_api.hpp"

namespace devbridge::cuda::testing {

// The (context, flags, device) form every driver still exports; cuda.h 13
// declares only the newer cuCtxCreate_v4, so nothing checks this one against
// a header.
using PFN_cuCtxCreate_v2 = detail::CUresult (*)(detail::CUcontext* context, unsigned int flags,
                                                detail::CUdevice device);
using PFN_cuCtxDestroy_v2 = detail::CUresult (*)(detail::CUcontext context);

}  // namespace devbridge::cuda::testing
