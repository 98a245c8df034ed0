// SPDX-License-Identifier: Apache-2.0
/*
 * The Maglev fill (maglev_fill.c) built into the package as an extension module when the
 * package is built or installed, so no node needs a compiler at run time. maglev.py imports
 * this module (a missing build is an ImportError, never a slow fallback) and calls the
 * exported am_maglev_fill through ctypes on the module's own shared object.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "maglev_fill.c"

static struct PyModuleDef am_maglev_native_module = {
	PyModuleDef_HEAD_INIT,
	"_maglev_native",
	"Weighted Maglev table fill (C), called through ctypes by adaptermesh.bpf.maglev.",
	-1,
	NULL,
};

PyMODINIT_FUNC PyInit__maglev_native(void)
{
	return PyModule_Create(&am_maglev_native_module);
}
