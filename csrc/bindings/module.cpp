// The extension module megatron_mok._C: `import megatron_mok._C` loads this library, and with it the
// op registrations of csrc/bindings/*.cpp (each adds its ops to the megatron_mok namespace with
// TORCH_LIBRARY_FRAGMENT); the module itself is empty.
#include <Python.h>

#include <torch/library.h>

TORCH_LIBRARY(megatron_mok, m) {}

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
