// The library's Python module (its PyInit is in tokens.cpp) takes functions from other files too.
#pragma once

#include <Python.h>

// Adds index_find, index_put, index_walk and index_gather (index_walk.cpp) to `module`; 0, or -1 with an error set.
int radixkv_add_index_functions(PyObject* module);
