// Precompiled header for project translation units: the heavy LibTorch headers most of them
// need. Public headers still include only what they use; this only speeds compilation.
#pragma once
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>
