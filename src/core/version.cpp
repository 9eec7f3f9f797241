#include "colossal/core/version.h"

namespace colossal {

std::string version() {
  return "0.1.0";
}

bool built_with_cuda() {
#ifdef COLOSSAL_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool built_with_gloo() {
#ifdef COLOSSAL_WITH_GLOO
  return true;
#else
  return false;
#endif
}

}  // namespace colossal
