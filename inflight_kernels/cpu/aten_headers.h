// The slice of ATen the kernel sources use: at::Tensor and its methods, TORCH_CHECK,
// at::parallel_for and the three factories they call. Not <torch/extension.h>, which
// pulls in pybind11 and the whole C++ frontend: parsing it took 18 s of the 21 s a small
// kernel file needed to compile (g++ 12 -O3, AMD EPYC Zen 5), about 2x that on older
// CPUs, once per source. Only module.cpp, which binds the ops to Python, includes it.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
