/* monitor.c - the native watchdog behind MemoryMonitor. */
#include "oc.h"

int oc_monitor_add_type(PyObject *module)
{
    (void)module;
    return 0;
}
