// Version of colossal.cpp and of what this build contains.
#pragma once

#include <string>

namespace colossal {

std::string version();
// "cuda" when CUDA sources were compiled into this build, "" otherwise.
bool built_with_cuda();
bool built_with_gloo();

}  // namespace colossal
