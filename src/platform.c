/* platform.c - machines where one of outofcuda's defaults cannot work, and
 * the defaults there. A row of this table names the platform, how it is
 * recognised and the evidence; bridge.c asks before it merges the allocator
 * defaults, and status()'s allocator reason carries the row's text. */
#include "oc.h"

#include <stdio.h>
#include <string.h>
#ifndef _WIN32
#include <sys/utsname.h>
#endif

/* Expandable segments where they cannot work:
 * - WSL2 (and WSL1): torch's Linux wheels run there unchanged. Their
 *   allocator has no notion of WSL: nothing is printed and nothing falls
 *   back; the driver's virtual-memory calls (cuMemCreate/cuMemMap/
 *   cuMemSetAccess) fail under WSL's GPU paravirtualisation, e.g.
 *   "CUDA driver error: unknown error" at the first allocation (pytorch
 *   issue 192330, a WSL driver bug fixed in R615 drivers only).
 * - native Windows: torch builds its driver-API path only where not WIN32
 *   (c10/cuda/CMakeLists.txt), so CUDAAllocatorConfig::expandable_segments()
 *   warns "expandable_segments not supported on this platform" once and
 *   returns false: the allocator falls back, but every process warns. */
#define WSL_WHY                                                                                    \
    "WSL kernel (%.64s): torch's allocator does not detect WSL and its expandable segments fail "  \
    "there in the driver's virtual-memory calls (pytorch issue 192330)"
#define WINDOWS_WHY                                                                                \
    "native Windows: torch's Windows builds have no expandable segments and warn "                 \
    "\"expandable_segments not supported on this platform\""

/* platform.c's own state (process-wide, under the GIL: see oc.h). */
static struct {
    /* Test door: a kernel release that replaces uname()'s. */
    int simulated;
    char simulated_release[128];
} platform;

/* The kernel's release (or the tests' stand-in) as printable ASCII, what
 * every kernel writes: any other byte reads as '?', so the text is safe in a
 * str, a report and a terminal. */
static const char *kernel_release(void)
{
    static char release[128];
    const char *raw = "";
    size_t i;
#ifndef _WIN32
    struct utsname u;
    if (!platform.simulated && uname(&u) == 0)
        raw = u.release;
#endif
    if (platform.simulated)
        raw = platform.simulated_release;
    for (i = 0; i < sizeof release - 1 && raw[i] != '\0'; i++) {
        unsigned char c = (unsigned char)raw[i];
        release[i] = c >= 0x20 && c < 0x7f ? (char)c : '?';
    }
    release[i] = '\0';
    return release;
}

/* NULL where expandable segments can work; otherwise why not (static). */
static const char *no_expandable_why(void)
{
    static char why[300];
    const char *rel;
#ifdef _WIN32
    if (!platform.simulated)
        return WINDOWS_WHY;
#endif
    rel = kernel_release();
    /* WSL2: "5.15.167.4-microsoft-standard-WSL2"; WSL1: "4.4.0-19041-Microsoft". */
    if (strcasestr(rel, "microsoft") == NULL && strstr(rel, "WSL") == NULL)
        return NULL;
    snprintf(why, sizeof why, WSL_WHY, rel);
    return why;
}

static int not_expandable(const char *key, void *ctx)
{
    (void)ctx;
    return strcmp(key, "expandable_segments") != 0;
}

const char *oc_platform_alloc_defaults(const char *defaults, int are_outofcudas, char *out,
                                       size_t outsz)
{
    /* The user's own OUTOFCUDA_ALLOC_CONF stands as written, here too. */
    if (!are_outofcudas || outsz == 0 || no_expandable_why() == NULL ||
        oc_alloc_merge(defaults, "", not_expandable, NULL, out, outsz, NULL, 0, NULL, 0) != 0)
        return defaults;
    return out;
}

const char *oc_platform_no_expandable(void)
{
    return no_expandable_why();
}

/* _platform() -> {"kernel_release", "expandable_segments_work", "why",
 * "alloc_defaults"}: the last is OUTOFCUDA_ALLOC_CONF's defaults as this
 * platform has them, before the merge (what `outofcuda doctor` shows). */
static PyObject *py_platform(PyObject *self, PyObject *unused)
{
    const oc_config *cfg = oc_config_get();
    const char *why = no_expandable_why();
    char buf[OC_ALLOC_CONF_MAX];
    (void)self;
    (void)unused;
    return Py_BuildValue(
        "{s:s,s:O,s:z,s:s}", "kernel_release", kernel_release(), "expandable_segments_work",
        why ? Py_False : Py_True, "why", why, "alloc_defaults",
        oc_platform_alloc_defaults(cfg->alloc_conf, cfg->alloc_conf_no_expandable[0] != '\0', buf,
                                   sizeof buf));
}

/* _testing.simulate_kernel_release(release or None): the tests' one way to stand on
 * another platform; None gives uname() back. */
static PyObject *py_simulate_kernel_release(PyObject *self, PyObject *arg)
{
    PyObject *bytes;
    (void)self;
    if (arg == Py_None) {
        platform.simulated = 0;
        Py_RETURN_NONE;
    }
    bytes = oc_arg_bytes(arg, "simulate_kernel_release expects a str or None");
    if (bytes == NULL)
        return NULL;
    snprintf(platform.simulated_release, sizeof platform.simulated_release, "%s",
             PyBytes_AsString(bytes));
    Py_DECREF(bytes);
    platform.simulated = 1;
    Py_RETURN_NONE;
}

OC_EDGE_NOARGS(py_platform)

PyMethodDef oc_platform_methods[] = {
    OC_METHOD(
        "_platform", py_platform,
        "_platform()\n--\n\nThe kernel release and whether expandable segments can work here."),
    {NULL, NULL, 0, NULL},
};

OC_EDGE_O(py_simulate_kernel_release)

PyMethodDef oc_platform_testing_methods[] = {
    OC_METHOD(
        "simulate_kernel_release", py_simulate_kernel_release,
        "simulate_kernel_release(release, /)\n--\n\nDecide as if uname() gave release (None: the "
        "real one)."),
    {NULL, NULL, 0, NULL},
};
