/* settings.c - the one table of every environment variable outofcuda reads,
 * and oc_env(), through which each is read. Pure C, data and look-ups only:
 * config.c parses the OUTOFCUDA_* ones into oc_config; the foreign ones
 * (other programs' variables that outofcuda acts on) are read where they
 * act. */
#define OC_PURE_C
#include "oc.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the table: every variable outofcuda reads ---- */

#define BOOL_WORDS "1/0, true/false, yes/no or on/off (none: off too)"
#define F(field) offsetof(oc_config, field)

static const char *const amp_words[] = {"auto",     "float16", "fp16", "half",
                                        "bfloat16", "bf16",    NULL};
static const int amp_values[] = {OC_AMP_AUTO,    OC_AMP_FLOAT16,  OC_AMP_FLOAT16,
                                 OC_AMP_FLOAT16, OC_AMP_BFLOAT16, OC_AMP_BFLOAT16};
static const char *const compile_modes[] = {"default", "reduce-overhead", "max-autotune",
                                            "max-autotune-no-cudagraphs", NULL};

/* Order: docs/environment.md's table. A foreign variable (another
 * program's, or one read where it acts) has no field: oc_env() reads it. */
static const oc_setting settings[] = {
    {"OUTOFCUDA_DISABLE", OC_SET_BOOL, "0", BOOL_WORDS, F(disable), 0, 0, NULL, NULL},
    {"OUTOFCUDA_VERBOSE", OC_SET_BOOL, "0", BOOL_WORDS, F(verbose), 0, 0, NULL, NULL},
    {"OUTOFCUDA_DEBUG", OC_SET_BOOL, "0", BOOL_WORDS, OC_NO_FIELD, 0, 0, NULL, NULL},
    {"OUTOFCUDA_TF32", OC_SET_BOOL, "1", BOOL_WORDS, F(tf32), 0, 0, NULL, NULL},
    {"OUTOFCUDA_CUDNN_BENCHMARK", OC_SET_BOOL, "1", BOOL_WORDS, F(cudnn_benchmark), 0, 0, NULL,
     NULL},
    {"OUTOFCUDA_CUDNN_DETERMINISTIC", OC_SET_BOOL, "0", BOOL_WORDS, F(cudnn_deterministic), 0, 0,
     NULL, NULL},
    {"OUTOFCUDA_CHANNELS_LAST", OC_SET_BOOL, "1", BOOL_WORDS, F(channels_last), 0, 0, NULL, NULL},
    {"OUTOFCUDA_COMPILE", OC_SET_BOOL, "0", BOOL_WORDS, F(compile), 0, 0, NULL, NULL},
    {"OUTOFCUDA_COMPILE_MODE", OC_SET_WORD, "reduce-overhead",
     "default, reduce-overhead, max-autotune or max-autotune-no-cudagraphs", F(compile_mode), 0, 0,
     compile_modes, NULL},
    {"OUTOFCUDA_COMPILE_FULLGRAPH", OC_SET_BOOL, "0", BOOL_WORDS, F(compile_fullgraph), 0, 0, NULL,
     NULL},
    {"OUTOFCUDA_AMP_DTYPE", OC_SET_WORD, "auto", "auto, float16 (fp16, half) or bfloat16 (bf16)",
     F(amp_dtype), 0, 0, amp_words, amp_values},
    {"OUTOFCUDA_MEMORY_FRACTION", OC_SET_FRACTION, "auto", "auto or a number f with 0 < f <= 1",
     F(memory_fraction), 0, 0, NULL, NULL},
    {"OUTOFCUDA_ALLOC_CONF", OC_SET_ALLOC, OC_DEFAULT_ALLOC_CONF,
     "a PyTorch allocator string such as 'expandable_segments:True' (key:value pairs separated "
     "by commas)",
     F(alloc_conf), 0, 0, NULL, NULL},
    {"OUTOFCUDA_GC_COLLECT", OC_SET_BOOL, "1", BOOL_WORDS, F(gc_collect), 0, 0, NULL, NULL},
    {"OUTOFCUDA_FLASH_ATTN", OC_SET_BOOL, "1", BOOL_WORDS, F(flash_attn), 0, 0, NULL, NULL},
    {"OUTOFCUDA_MEM_EFF_ATTN", OC_SET_BOOL, "1", BOOL_WORDS, F(mem_eff_attn), 0, 0, NULL, NULL},
    {"OUTOFCUDA_MATH_ATTN", OC_SET_BOOL, "1", BOOL_WORDS, F(math_attn), 0, 0, NULL, NULL},
    {"OUTOFCUDA_PIN_MEMORY", OC_SET_BOOL, "1", BOOL_WORDS, F(pin_memory), 0, 0, NULL, NULL},
    {"OUTOFCUDA_NUM_WORKERS", OC_SET_LONG, "4", "a whole number from 0 to 1024", F(num_workers), 0,
     1024, NULL, NULL},
    {"OUTOFCUDA_PREFETCH_FACTOR", OC_SET_LONG, "2", "a whole number from 1 to 1024",
     F(prefetch_factor), 1, 1024, NULL, NULL},
    {"OUTOFCUDA_OOM_SNAPSHOT", OC_SET_TEXT, NULL,
     "the path of a file in an existing directory (checked by oom.c)", OC_NO_FIELD, 0, 0, NULL,
     NULL},
    {"OUTOFCUDA_OOM_KEEP_FRAMES", OC_SET_BOOL, "0", BOOL_WORDS, F(oom_keep_frames), 0, 0, NULL,
     NULL},
    {"OUTOFCUDA_SUMMARY", OC_SET_SUMMARY, "0",
     "1/0 (the summary on stderr at exit, or none) or the path of a .json file to write it to "
     "(under 1024 characters)",
     F(summary), 0, 0, NULL, NULL},
    {"OUTOFCUDA_FRAMEWORK_OVERRIDE", OC_SET_BOOL, "0", BOOL_WORDS, F(framework_override), 0, 0,
     NULL, NULL},
    {"OUTOFCUDA_KNOWN_BUGS", OC_SET_KNOWN_BUGS, "1",
     BOOL_WORDS " (every row), or the ids of the rows to turn off, separated by commas",
     F(known_bugs), 0, 0, NULL, NULL},
    /* Foreign: read where they act. */
    {"NVIDIA_TF32_OVERRIDE", OC_SET_FOREIGN, NULL, "0 turns TF32 off in NVIDIA's libraries",
     OC_NO_FIELD, 0, 0, NULL, NULL},
    {"LOCAL_RANK", OC_SET_FOREIGN, NULL, "torchrun's rank on this node: this process's device",
     OC_NO_FIELD, 0, 0, NULL, NULL},
    {"RANK", OC_SET_FOREIGN, NULL, "torchrun's global rank: [rank N] on every line printed",
     OC_NO_FIELD, 0, 0, NULL, NULL},
    {"CUDA_VISIBLE_DEVICES", OC_SET_FOREIGN, NULL, "the devices CUDA shows (NVML's map)",
     OC_NO_FIELD, 0, 0, NULL, NULL},
    {"PYTORCH_CUDA_ALLOC_CONF", OC_SET_FOREIGN, NULL, "torch's allocator string", OC_NO_FIELD, 0, 0,
     NULL, NULL},
    {"PYTORCH_HIP_ALLOC_CONF", OC_SET_FOREIGN, NULL, "torch's allocator string (2.11+)",
     OC_NO_FIELD, 0, 0, NULL, NULL},
    {"PYTORCH_ALLOC_CONF", OC_SET_FOREIGN, NULL, "torch's allocator string (2.11+)", OC_NO_FIELD, 0,
     0, NULL, NULL},
    {"TORCH_CUDNN_SDPA_DEPRIORITIZED", OC_SET_FOREIGN, NULL,
     "1: torch keeps cuDNN attention last (known bugs)", OC_NO_FIELD, 0, 0, NULL, NULL},
    {"LD_PRELOAD", OC_SET_FOREIGN, NULL, "torch_memory_saver's hook library (frameworks)",
     OC_NO_FIELD, 0, 0, NULL, NULL},
    {"LD_LIBRARY_PATH", OC_SET_FOREIGN, NULL, "searched for another cuDNN 9 (known bugs)",
     OC_NO_FIELD, 0, 0, NULL, NULL},
};

size_t oc_setting_count(void)
{
    return sizeof settings / sizeof settings[0];
}

const oc_setting *oc_setting_at(size_t i)
{
    return i < oc_setting_count() ? &settings[i] : NULL;
}

const oc_setting *oc_setting_named(const char *name)
{
    for (size_t i = 0; name != NULL && i < oc_setting_count(); i++) {
        if (strcmp(settings[i].name, name) == 0)
            return &settings[i];
    }
    return NULL;
}

const char *oc_env(const char *name)
{
    /* Every variable is in the table (tests/test_static.py checks the
     * names passed here); one that is not reads as unset. */
    return oc_setting_named(name) != NULL ? getenv(name) : NULL;
}

long oc_env_rank(const char *name)
{
    const char *s = oc_env(name);
    char *end;
    long r;
    if (s == NULL || !*s)
        return -1;
    errno = 0;
    r = strtol(s, &end, 10);
    return (errno == 0 && *end == '\0' && r >= 0 && r < 1000000) ? r : -1;
}

/* ---- which process of a torchrun job speaks ---- */

/* 1 when argv (NUL-separated, len bytes) starts torchrun's launcher: the
 * torchrun script, or `python -m torch.distributed.run` (or .launch). */
static int launcher_argv(const char *argv, size_t len)
{
    const char *a = argv, *prev = "";
    for (int i = 0; a < argv + len && i < 8; i++) {
        const char *base = strrchr(a, '/');
        base = base ? base + 1 : a;
        if ((i <= 1 && strcmp(base, "torchrun") == 0) ||
            (strcmp(prev, "-m") == 0 && (strcmp(a, "torch.distributed.run") == 0 ||
                                         strcmp(a, "torch.distributed.launch") == 0)))
            return 1;
        prev = a;
        a += strlen(a) + 1;
    }
    return 0;
}

int oc_torchrun_launcher(void)
{
    static int known = -1;
    if (known < 0) {
        char buf[4096];
        FILE *f = fopen("/proc/self/cmdline", "rb");
        size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
        if (f)
            fclose(f);
        buf[n] = '\0';
        known = launcher_argv(buf, n);
    }
    return known && oc_env_rank("RANK") < 0 && oc_env_rank("LOCAL_RANK") < 0;
}

long oc_job_rank(void)
{
    long rank = oc_env_rank("RANK");
    return rank >= 0 ? rank : oc_env_rank("LOCAL_RANK");
}

const char *oc_rank_label(void)
{
    static char label[32];
    long rank = oc_job_rank();
    if (rank >= 0)
        snprintf(label, sizeof label, "[rank %ld] ", rank);
    else
        snprintf(label, sizeof label, "%s", oc_torchrun_launcher() ? "[launcher] " : "");
    return label;
}
