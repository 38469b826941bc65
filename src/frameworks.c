/* frameworks.c - packages that manage GPU memory themselves. They size it
 * (vLLM's gpu_memory_utilization, SGLang's KV pool from cudaMemGetInfo),
 * toggle expandable segments around their own pools and choose code paths
 * from PYTORCH_CUDA_ALLOC_CONF. Under them outofcuda's allocator string and
 * memory fraction only break those decisions, so bridge.c leaves both alone
 * where oc_framework_in_use() names one. Each row was read in the package's
 * own released sources (wheels from PyPI). */
#include "oc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const oc_framework oc_frameworks[] = {
    {"vllm", "vLLM",
     "sizes GPU memory itself (gpu_memory_utilization), turns expandable segments off around its "
     "CuMem pool, and refuses KV connectors when PYTORCH_CUDA_ALLOC_CONF turns expandable "
     "segments on",
     "https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/config/vllm.py"},
    {"sglang", "SGLang",
     "sizes its KV cache from torch.cuda.mem_get_info, and its Mooncake transfer and weight-cache "
     "paths refuse expandable segments read from the allocator variable",
     "https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/disaggregation/"
     "mooncake/utils.py"},
    {"torch_memory_saver", "torch_memory_saver",
     "replaces cudaMalloc (LD_PRELOAD) and refuses to run when PYTORCH_CUDA_ALLOC_CONF holds "
     "expandable_segments:True",
     "https://github.com/fzyzcjy/torch_memory_saver/blob/v0.0.10/torch_memory_saver/"
     "entrypoint.py"},
    {NULL, NULL, NULL, NULL},
};

/* torch_memory_saver's preload library: torch_memory_saver_hook_mode_preload*.so */
#define TMS_PRELOAD "torch_memory_saver"

/* 1 when one of LD_PRELOAD's entries is a file whose name (after its last
 * '/') starts with TMS_PRELOAD; a directory of that name elsewhere in the
 * path is not the library. ld.so splits the list at colons and spaces. */
static int tms_preloaded(const char *preload)
{
    const char *p = preload;
    while (p != NULL && *p) {
        size_t n = strcspn(p, ": ");
        const char *base = p;
        for (size_t i = 0; i < n; i++) {
            if (p[i] == '/')
                base = p + i + 1;
        }
        if ((size_t)(p + n - base) >= strlen(TMS_PRELOAD) &&
            strncmp(base, TMS_PRELOAD, strlen(TMS_PRELOAD)) == 0)
            return 1;
        p += n;
        p += strspn(p, ": ");
    }
    return 0;
}

/* 1 when sys.modules holds `name`. Reads the dict only: no import, no
 * attribute of the module (it may be half initialised). */
static int in_sys_modules(const char *name)
{
    PyObject *modules = PySys_GetObject("modules"); /* borrowed */
    PyObject *m = modules && PyDict_Check(modules) ? PyDict_GetItemString(modules, name) : NULL;
    /* Absence is the answer: PyDict_GetItemString sets nothing. */
    return m != NULL && m != Py_None;
}

static const char *found(const oc_framework *f, const char *seen, char *why, size_t whysz)
{
    if (why != NULL && whysz > 0)
        snprintf(why, whysz, "%s (%s) %s; evidence: %s", f->name, seen, f->owns, f->evidence);
    return f->name;
}

const char *oc_framework_in_use(char *why, size_t whysz)
{
    const char *preload = oc_env("LD_PRELOAD");
    if (why != NULL && whysz > 0)
        why[0] = '\0';
    /* torch_memory_saver, preloaded, comes last: a framework imported wins. */
    for (const oc_framework *f = oc_frameworks; f->package; f++) {
        if (in_sys_modules(f->package))
            return found(f, "imported in this process", why, whysz);
        if (strcmp(f->package, "torch_memory_saver") == 0 && tms_preloaded(preload))
            return found(f, "preloaded through LD_PRELOAD", why, whysz);
    }
    return NULL;
}

const char *oc_framework_evidence(const char *name)
{
    const oc_framework *f = oc_frameworks;
    while (f->package && strcmp(f->name, name) != 0)
        f++;
    return f->evidence; /* the end row's: NULL */
}

/* What bridge.c decided about frameworks, here below both bridge.c, which
 * decides it at torch's import and at CUDA's start, and report.c, which
 * shows it. */
static oc_framework_choice choice;

const oc_framework_choice *oc_framework_choice_get(void)
{
    return &choice;
}

void oc_framework_leave_to(const char *name, const char *why)
{
    snprintf(choice.left_to, sizeof choice.left_to, "%s", name ? name : "");
    if (name != NULL)
        snprintf(choice.why, sizeof choice.why, "%s", why);
}

void oc_framework_decided(int when, oc_fw_code code)
{
    choice.at[when != 0] = code;
}
