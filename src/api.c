/* api.c - the decisions behind the Python API (outofcuda/api.py): autocast
 * dtype, DataLoader worker counts, memory figures. */
#include "oc.h"

PyMethodDef oc_api_methods[] = {
    {NULL, NULL, 0, NULL},
};
