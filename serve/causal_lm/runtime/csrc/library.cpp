// The kernel library as one translation unit (kernels.py builds this file alone): each
// source below includes torch's headers, whose parsing is most of a source's compile time,
// so one unit parses them once where six did (a build about half the compiler's CPU time).
// The sources share the `compress_lm` namespace and its anonymous one: a name is defined in
// one of them (or in grouped_layout.h) only. grouped_kernels.cpp holds the TORCH_LIBRARY
// block, the others add fragments.

#include "grouped_kernels.cpp"
#include "grouped_int8_activations.cpp"
#include "grouped_bf16_activations.cpp"
#include "sparse24_kernel.cpp"
#include "routed_experts.cpp"
#include "cache_attention.cpp"
#include "package_runner.cpp"
