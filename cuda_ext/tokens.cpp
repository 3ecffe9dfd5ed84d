// Token ids from a Python list or tuple to little-endian int32 bytes, in one C loop: the fast path
// of radixkv.core.hashing.as_token_bytes, which engines call once per request (they hold token ids as
// Python lists).  About 1-2 ns a token against about 8 for array.array plus numpy's checks.
//
//   token_bytes(seq) -> bytes | None
//
// Returns the bytes when every element is an exact int in [0, 2**31), and None for anything else
// (a bool, a float, a numpy integer, a negative or a too-large id, another container): the caller
// then takes its exact path, which raises the error that names the argument.  Never raises itself,
// except MemoryError.
//
// The library that holds the block-copy ops is also importable as a Python module of this
// function and the fleet index's (index_walk.cpp, added through native.h): cpp_extension names the
// build TORCH_EXTENSION_NAME, and PyInit_<that name> is here.

#include <Python.h>

#include <cstdint>
#include <cstring>

#include "native.h"

namespace {

// An int of at most one digit (below 2**30), read without a call: most token ids.
inline bool compact_value(PyObject* item, long* value) {
#if PY_VERSION_HEX >= 0x030C0000
  if (!PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(item))) return false;
  *value = static_cast<long>(PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(item)));
  return true;
#else
  const Py_ssize_t size = Py_SIZE(item);
  if (size == 0 || size == 1) {
    *value = size == 0 ? 0 : static_cast<long>(reinterpret_cast<PyLongObject*>(item)->ob_digit[0]);
    return true;
  }
  return false;
#endif
}

PyObject* token_bytes(PyObject* /*module*/, PyObject* seq) {
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_NONE;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);  // a list cannot change size: no Python code runs below
  PyObject* out = PyBytes_FromStringAndSize(nullptr, n * 4);
  if (out == nullptr) return nullptr;
  auto* dst = reinterpret_cast<unsigned char*>(PyBytes_AS_STRING(out));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    if (!PyLong_CheckExact(item)) {
      Py_DECREF(out);
      Py_RETURN_NONE;
    }
    long value;
    if (!compact_value(item, &value)) {
      int overflow = 0;
      value = PyLong_AsLongAndOverflow(item, &overflow);
      if (overflow != 0) value = -1;
    }
    if (value < 0 || value > 0x7fffffffL) {
      Py_DECREF(out);
      Py_RETURN_NONE;
    }
    const auto v = static_cast<uint32_t>(value);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    const uint32_t le = __builtin_bswap32(v);
#else
    const uint32_t le = v;
#endif
    std::memcpy(dst + 4 * i, &le, 4);
  }
  return out;
}

PyMethodDef methods[] = {
    {"token_bytes", token_bytes, METH_O,
     "token_bytes(seq) -> bytes | None: an exact-int list or tuple of ids in [0, 2**31) as int32 LE bytes"},
    {nullptr, nullptr, 0, nullptr},
};

#define RADIXKV_STR2(x) #x
#define RADIXKV_STR(x) RADIXKV_STR2(x)
#define RADIXKV_CAT2(a, b) a##b
#define RADIXKV_CAT(a, b) RADIXKV_CAT2(a, b)

PyModuleDef module = {PyModuleDef_HEAD_INIT, RADIXKV_STR(TORCH_EXTENSION_NAME),
                      "radixkv's native helpers (see cuda_ext/tokens.cpp)", -1, methods};

}  // namespace

PyMODINIT_FUNC RADIXKV_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr && radixkv_add_index_functions(m) != 0) Py_CLEAR(m);
  return m;
}
