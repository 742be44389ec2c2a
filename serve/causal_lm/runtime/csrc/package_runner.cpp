// AOTInductor packages run through torch operators, so that a call from Python lets go of
// the GIL while the compiled graph runs. torch._C._aoti's binding of the package loader
// holds the GIL for the whole run: while a served decode step ran (25-30 ms at 8 rows on a
// 2-core CPU), no other Python thread of the worker ran (the engine's event loop that
// reads and parses requests, the tokenizer's thread), so a request waited for the steps to
// end to become a row. An operator's call from Python releases the GIL (as every torch
// operator does), and a compiled graph calls C++ operators only.
//
// package_load(path, model) -> a handle; the others take it. Packages live as long as the
// process (a worker loads a few, once).
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace compress_lm {
namespace {

std::mutex packages_mutex;

std::vector<std::unique_ptr<torch::inductor::AOTIModelPackageLoader>>& packages() {
  static std::vector<std::unique_ptr<torch::inductor::AOTIModelPackageLoader>> held;
  return held;
}

torch::inductor::AOTIModelPackageLoader& package(int64_t handle) {
  std::lock_guard<std::mutex> guard(packages_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(packages().size()),
              "package_run: no package ", handle);
  return *packages()[handle];
}

}  // namespace

int64_t package_load(const std::string& path, const std::string& model) {
  auto loaded = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path, model, false, 1,
                                                                         -1);
  std::lock_guard<std::mutex> guard(packages_mutex);
  packages().push_back(std::move(loaded));
  return static_cast<int64_t>(packages().size()) - 1;
}

std::vector<std::string> package_constant_fqns(int64_t handle) {
  return package(handle).get_constant_fqns();
}

std::vector<std::string> package_call_spec(int64_t handle) {
  return package(handle).get_call_spec();
}

// the weights by name (`user_managed`: the tensors themselves, kept alive by the caller)
void package_load_constants(int64_t handle, std::vector<std::string> names,
                            std::vector<at::Tensor> values, bool check_full_update,
                            bool user_managed) {
  TORCH_CHECK(names.size() == values.size(), "package_load_constants: ", names.size(),
              " names for ", values.size(), " tensors");
  std::unordered_map<std::string, at::Tensor> constants;
  for (size_t i = 0; i < names.size(); ++i) constants.emplace(names[i], values[i]);
  package(handle).load_constants(constants, false, check_full_update, user_managed);
}

std::vector<at::Tensor> package_run(int64_t handle, std::vector<at::Tensor> inputs) {
  return package(handle).boxed_run(std::move(inputs));
}

}  // namespace compress_lm

TORCH_LIBRARY_FRAGMENT(compress_lm, m) {
  m.def("package_load(str path, str model) -> int", &compress_lm::package_load);
  m.def("package_constant_fqns(int handle) -> str[]", &compress_lm::package_constant_fqns);
  m.def("package_call_spec(int handle) -> str[]", &compress_lm::package_call_spec);
  m.def("package_load_constants(int handle, str[] names, Tensor[] values, "
        "bool check_full_update, bool user_managed) -> ()",
        &compress_lm::package_load_constants);
  m.def("package_run(int handle, Tensor[] inputs) -> Tensor[]", &compress_lm::package_run);
}
