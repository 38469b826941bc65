/* kbtable.c - the known-bugs table and its lookup. Pure C: no Python here,
 * so the table can be tested at every range's edge and fuzzed on its own
 * (tests/known_bugs/driver.c, the configuration's fuzz target, which reads
 * OUTOFCUDA_KNOWN_BUGS's row ids through it); knownbugs.c applies it to the
 * running torch. */
#ifndef OC_PURE_C /* the test drivers define it too */
#define OC_PURE_C
#endif
#include "oc.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the table (pure C) ---- */

/* One row: id, title, torch, cuDNN, compute capability, unless_env,
 * condition, action, needs, action_text, evidence, CUDA, fixed_in, fix,
 * NCCL (oc.h's oc_known_bug, in that order). */
/* clang-format off */
#define OC_KB_ROW(...) {__VA_ARGS__, {0, 0}} /* any NCCL */
#define OC_KB_ROW_NCCL(...) {__VA_ARGS__}
/* clang-format on */
#define OC_KB_NO_SDPA_TEXT                                                                         \
    "cuDNN attention turned off (torch._C._set_sdp_use_cudnn(False), what "                        \
    "enable_cudnn_sdp(False) does); sdpa_kernel() blocks still choose for themselves"
#define OC_KB_NO_SDPA_FIX                                                                          \
    "call torch.backends.cuda.enable_cudnn_sdp(False), or set TORCH_CUDNN_SDPA_DEPRIORITIZED=1"

static const oc_known_bug table[] = {
    /* 2.11 puts cuDNN first in the SDPA order on sm90/sm100 above cuDNN 9.15.0
     * (check_prefer_cudnn_attention); the backend fix is in 9.26
     * (cudnn-frontend PR 628), which 2.15 bundles and guards (PR 196861). The
     * failing kernel is sm90's; sm100 is not reported. */
    OC_KB_ROW("cudnn-sdpa-nan-grad-sm90",
              "cuDNN attention backward gives NaN grad_q on sm90 (attn_mask, seq_len % 128 == 64, "
              "a row's logsumexp below -88.7)",
              {21100, 21500}, {91501, 92600}, {90, 100}, OC_VAR("TORCH_CUDNN_SDPA_DEPRIORITIZED"),
              "cuDNN attention is torch's default SDPA backend there; the NaN needs an explicit "
              "attn_mask in a backward pass",
              OC_KB_SDPA_NO_CUDNN, 0, OC_KB_NO_SDPA_TEXT,
              "https://github.com/pytorch/pytorch/issues/196678", {0, 0},
              "torch 2.15.0 (cuDNN 9.26)", OC_KB_NO_SDPA_FIX),
    /* Reported on 2.9.1, verified fixed in 2.11.0; 2.9.0 introduced the
     * name and 2.10 reads as 2.9 does (allocconf.c). */
    OC_KB_ROW(
        "alloc-conf-generic-ignored",
        "the CUDA allocator ignores PYTORCH_ALLOC_CONF (expandable_segments:True and every "
        "other key set there do nothing; only PYTORCH_CUDA_ALLOC_CONF is read)",
        {20900, 21100}, {0, 0}, {0, 0}, NULL,
        "PYTORCH_ALLOC_CONF is set and PYTORCH_CUDA_ALLOC_CONF is not", OC_KB_ALLOC_GENERIC,
        OC_KB_NEEDS_ALLOC_GENERIC,
        "the user's PYTORCH_ALLOC_CONF keys are merged into outofcuda's allocator string, "
        "which torch's runtime setter (or PYTORCH_CUDA_ALLOC_CONF while torch loads) hands "
        "to the CUDA allocator",
        "https://github.com/pytorch/pytorch/issues/183387", {0, 0}, "torch 2.11.0",
        "set PYTORCH_CUDA_ALLOC_CONF instead of PYTORCH_ALLOC_CONF, or upgrade to torch 2.11"),
    OC_KB_ROW("torchrun-gpu0-context",
              "a torchrun rank other than 0 holds a CUDA context (0.5 to 1 GiB) on a device that "
              "is not LOCAL_RANK's, usually cuda:0, when it used CUDA before "
              "torch.cuda.set_device",
              {0, 0}, {0, 0}, {0, 0}, NULL,
              "LOCAL_RANK is set above 0 and NVML lists this process on another visible device",
              OC_KB_REPORT, OC_KB_NEEDS_FOREIGN_CTX,
              "named in status(), `outofcuda doctor` and the exit summary; outofcuda itself "
              "touches only LOCAL_RANK's device when CUDA starts",
              "https://github.com/pytorch/pytorch/issues/135279", {0, 0}, NULL,
              "call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before the first CUDA "
              "use, or pass device_id to init_process_group"),
    /* torch 2.12.1+cu130 pins nvidia-cudnn-cu13 9.20.0.48 (reported); the
     * sub-library ships from cuDNN 9.23 on. */
    OC_KB_ROW("cudnn-sublibrary-mismatch",
              "the cuDNN 9.20 wheel of CUDA 13 builds lacks libcudnn_engines_tensor_ir: with "
              "another cuDNN 9 on the loader path the first convolution fails (status "
              "CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH)",
              {0, 0}, {92000, 92300}, {0, 0}, NULL,
              "another cuDNN 9 (a system install, LD_LIBRARY_PATH) is on the loader path",
              OC_KB_REPORT, OC_KB_NEEDS_OTHER_CUDNN,
              "named in `outofcuda doctor` and the exit summary",
              "https://github.com/pytorch/pytorch/issues/188892", {1300, 1400},
              "cuDNN 9.23 (nvidia-cudnn-cu13 9.23 or newer)",
              "take the other cuDNN off the loader path (LD_LIBRARY_PATH, ldconfig), or install "
              "nvidia-cudnn-cu13 9.23 or newer into the environment"),
    /* FSDPModule's divide-factor setter arrived in 2.5; fixed on main by
     * pytorch PR 190747 (2026-07), no release confirmed: no upper bound. */
    OC_KB_ROW("fsdp2-bf16-premul-sum",
              "NCCL PREMUL_SUM over bfloat16 reads the factor as zero for powers of two: FSDP2 "
              "with a custom gradient_divide_factor (2, 4, 8, ...) and bf16 reduce_dtype gives "
              "zero gradients",
              {20500, 0}, {0, 0}, {0, 0}, NULL,
              "FSDP2 (fully_shard) with set_gradient_divide_factor/"
              "set_reduce_scatter_divide_factor of a power of two and a bfloat16 reduce_dtype, "
              "over NCCL",
              OC_KB_REPORT, 0, "named in `outofcuda doctor`",
              "https://github.com/pytorch/pytorch/issues/190745", {0, 0}, NULL,
              "use a reduce_dtype of float32 in MixedPrecisionPolicy, or a divide factor that is "
              "not a power of two; fixed upstream by pytorch PR 190747"),
    /* Fixed on main by pytorch PR 188345 (2026-07); the first release
     * holding it is not confirmed, so no upper bound. */
    OC_KB_ROW("avg-pool2d-channels-last-grad",
              "avg_pool2d backward on CUDA gives wrong input gradients for channels_last inputs "
              "with padding > 0 (silently)",
              {0, 0}, {0, 0}, {0, 0}, NULL,
              "a channels_last input (compile_model converts 4-D models) to AvgPool2d with "
              "padding > 0, in training",
              OC_KB_REPORT, 0, "named in `outofcuda doctor`",
              "https://github.com/pytorch/pytorch/issues/188344", {0, 0}, NULL,
              "OUTOFCUDA_CHANNELS_LAST=0 (or compile_model(channels_last=False)) for models with "
              "padded AvgPool2d; fixed upstream by pytorch PR 188345"),
    /* 2.9 added the fp32_precision API (pytorch PR 125888). */
    OC_KB_ROW("tf32-mixed-api",
              "after only the new TF32 API (torch.backends.cuda.matmul.fp32_precision) is set, a "
              "read of the legacy one (allow_tf32, get_float32_matmul_precision) raises \"mix of "
              "the legacy and new APIs\"",
              {20900, 0}, {0, 0}, {0, 0}, NULL,
              "a program, or a library it uses, sets only the new API and something reads the "
              "legacy one (Inductor's cache key, transformers)",
              OC_KB_TF32_LEGACY, 0,
              "outofcuda sets TF32 only through torch._C._set_cublas_allow_tf32, which writes the "
              "legacy and the new state alike, and leaves TF32 alone where the program chose a "
              "precision: nothing it sets makes a later read of either API raise",
              "https://github.com/pytorch/pytorch/issues/179445", {0, 0}, NULL,
              "set TF32 through one API only: torch.set_float32_matmul_precision or allow_tf32 "
              "(both keep the states in sync), or the new fp32_precision attributes everywhere"),
    /* cuDNN is torch's first SDPA backend on sm90 from 2.11; reported with
     * 9.25.1 and 9.26.0.51, open, no fixed cuDNN. */
    OC_KB_ROW("cudnn-sdpa-nan-dkdv-sq1",
              "cuDNN attention backward gives NaN dK/dV on H200 for a single query row (Sq=1) "
              "with a strongly negative logsumexp",
              {21100, 0}, {92501, 92700}, {90, 100}, OC_VAR("TORCH_CUDNN_SDPA_DEPRIORITIZED"),
              "a backward pass with one query row (decoding-style training shapes), no mask "
              "needed",
              OC_KB_REPORT, 0,
              "named in `outofcuda doctor` and the exit summary (outofcuda does not turn cuDNN "
              "attention off for it: the shape is rare and no fixed version bounds it)",
              "https://github.com/NVIDIA/cudnn-frontend/issues/1072", {0, 0}, NULL,
              OC_KB_NO_SDPA_FIX),
    /* Confirmed on 2.11.0+cu128 (cuDNN 9.19) and 2.13.0+cu130 (9.20), open. */
    OC_KB_ROW("cudnn-sdpa-gqa-sm100",
              "cuDNN attention silently corrupts greedy generation on B200 (sm_100) for models "
              "with fewer than 8 KV heads",
              {21100, 0}, {0, 0}, {100, 101}, OC_VAR("TORCH_CUDNN_SDPA_DEPRIORITIZED"),
              "cuDNN attention is torch's default SDPA backend there; seen with Qwen2 models (2 "
              "and 4 KV heads, head_dim 128)",
              OC_KB_SDPA_NO_CUDNN, 0, OC_KB_NO_SDPA_TEXT,
              "https://github.com/pytorch/pytorch/issues/193893", {0, 0}, NULL, OC_KB_NO_SDPA_FIX),
    /* 2.9 made cuDNN attention the default on sm90 and sm100 (PR 162073);
     * 2.10 turns it off by default below CUDA 12.9 (PR 171627, cherry-picked
     * in PR 171895): the steer is torch's own later fix. */
    OC_KB_ROW("cudnn-sdpa-ima-cuda-below-12.9",
              "cuDNN attention reads out of bounds (illegal memory access) on torch 2.9 builds "
              "for CUDA below 12.9",
              {20900, 21000}, {0, 0}, {90, 101}, NULL,
              "cuDNN attention is torch 2.9's default SDPA backend there", OC_KB_SDPA_NO_CUDNN, 0,
              OC_KB_NO_SDPA_TEXT, "https://github.com/pytorch/pytorch/issues/169849", {1200, 1209},
              "torch 2.10.0", OC_KB_NO_SDPA_FIX),
    /* NCCL 2.29.3's notes: "Fixed CAS usage in case of weak failure which
     * was causing a hang on ARM"; torch moved to it in PR 174338 (2.12). */
    OC_KB_ROW_NCCL(
        "nccl-aarch64-hang",
        "NCCL before 2.29.3 loses proxy-op slots on aarch64 (GH200, GB200): collectives "
        "hang with no error and no timeout",
        {0, 0}, {0, 0}, {0, 0}, NULL, "collectives over NCCL on an aarch64 machine", OC_KB_REPORT,
        OC_KB_NEEDS_AARCH64, "named in `outofcuda doctor` and the exit summary",
        "https://github.com/pytorch/pytorch/pull/174338", {0, 0}, "NCCL 2.29.3 (torch 2.12)",
        "pip install 'nvidia-nccl-cu12>=2.29.3' (nvidia-nccl-cu13 for CUDA 13 builds): torch "
        "loads it in place of the pinned one",
        {0, 22903}),
    /* cuDNN 9.11.0's release notes drop compute capability below 7.5. */
    OC_KB_ROW("cudnn-pre-turing",
              "cuDNN 9.11 and newer have no kernels for GPUs below compute capability 7.5 (V100, "
              "Pascal): cuDNN convolutions fail with unclear errors",
              {0, 0}, {91100, 0}, {30, 75}, NULL,
              "a cuDNN operation (convolution, cuDNN attention)", OC_KB_REPORT, 0,
              "named in `outofcuda doctor` and the exit summary",
              "https://github.com/pytorch/pytorch/issues/162574", {0, 0}, NULL,
              "pip install 'nvidia-cudnn-cu12<9.11' (or a torch wheel that bundles cuDNN 9.10), or "
              "torch.backends.cudnn.enabled = False"),
    /* Wrong results from cuDNN 9.10.2 (163539); 2.9.0 then avoids cuDNN for
     * it at about 3x memory, 2.9.1 only below cuDNN 9.15 (166643). */
    OC_KB_ROW("conv3d-half-cudnn",
              "conv3d in fp16/bf16 with cuDNN 9.10.2 to 9.14: wrong results on large inputs "
              "(torch 2.8), or torch's fallback at about 3x the memory (2.9 on)",
              {0, 0}, {91002, 91500}, {0, 0}, NULL, "Conv3d in float16 or bfloat16", OC_KB_REPORT,
              0, "named in `outofcuda doctor` and the exit summary",
              "https://github.com/pytorch/pytorch/issues/163539", {0, 0}, "cuDNN 9.15",
              "pip install 'nvidia-cudnn-cu12>=9.15' (torch 2.9.1 and newer use cuDNN for it "
              "again)"),
    /* cudnn-frontend PR 414: only 9.24 has the split-KV kernel; 9.25.0 fixes it. */
    OC_KB_ROW("cudnn-fp8-sdpa-zeros",
              "cuDNN 9.24 FP8 attention forward on Blackwell returns zeros in a BF16 output "
              "(split-KV kernel)",
              {0, 0}, {92400, 92500}, {100, 110}, NULL,
              "FP8/MXFP8 attention through cuDNN with a bfloat16 output, s_q > 1, s_kv >= 4096, "
              "no causal band",
              OC_KB_REPORT, 0, "named in `outofcuda doctor` and the exit summary",
              "https://github.com/NVIDIA/cudnn-frontend/pull/414", {0, 0}, "cuDNN 9.25.0",
              "pip install 'nvidia-cudnn-cu13>=9.25'"),
    /* Reported 14.5 GB compiled against 11 on 2.9.1; the reporter found
     * 2.12 fixed. */
    OC_KB_ROW("compile-vram-2.10",
              "torch.compile uses about 30% more GPU memory on 2.10 and 2.11 than on 2.9.1",
              {21000, 21200}, {0, 0}, {0, 0}, NULL, "a model run through torch.compile",
              OC_KB_REPORT, 0, "named in `outofcuda doctor`",
              "https://github.com/pytorch/pytorch/issues/175058", {0, 0}, "torch 2.12",
              "upgrade to torch 2.12"),
    /* PR 179618 (2.13) widened the header of an expandable segment's IPC
     * handle to 32 bytes and stores 24 of them: read in libc10_cuda.so of
     * 2.14.1 and 2.15.0 (handle version 3, which 2.12 and older refuse);
     * 2.12.1 zeroes its 24-byte header (version 2). */
    OC_KB_ROW("expandable-ipc-2.13",
              "a CUDA IPC handle of an expandable segment (outofcuda's default) holds 8 "
              "uninitialised bytes: memory shared twice gets two handles, and the receiving "
              "process imports and maps it again each time",
              {21300, 0}, {0, 0}, {0, 0}, NULL,
              "CUDA tensors sent to another process (torch.multiprocessing, DataLoader workers, "
              "weight refit to an inference process)",
              OC_KB_IPC_NO_EXPANDABLE, 0,
              "expandable segments of outofcuda's defaults off from CUDA's start in a DataLoader "
              "worker (its CUDA tensors leave it only by CUDA IPC); named in doctor elsewhere",
              "https://github.com/pytorch/pytorch/issues/198305", {0, 0}, NULL,
              "OUTOFCUDA_ALLOC_CONF=garbage_collection_threshold:0.8 (expandable segments off) in "
              "processes that send CUDA tensors; torch 2.12 and older read no 2.13 handle"),
};

/* knownbugs.c keeps a verdict and a reason for each row. */
_Static_assert(sizeof table / sizeof table[0] <= OC_KB_MAX_ENTRIES, "a row past OC_KB_MAX_ENTRIES");

size_t oc_known_bug_count(void)
{
    return sizeof table / sizeof table[0];
}

const oc_known_bug *oc_known_bug_at(size_t i)
{
    return i < oc_known_bug_count() ? &table[i] : NULL;
}

int oc_known_bug_index(const char *id, size_t len)
{
    if (id == NULL)
        return -1;
    if (len == 0)
        len = strlen(id);
    for (size_t i = 0; i < oc_known_bug_count(); i++) {
        if (strlen(table[i].id) == len && strncmp(table[i].id, id, len) == 0)
            return (int)i;
    }
    return -1;
}

int oc_known_bugs_parse_off(const char *value, unsigned long *off, char *unknown, size_t sz)
{
    unsigned long bits = 0;
    size_t used = 0;
    int bad = 0;
    if (value == NULL)
        return -1;
    if (sz > 0)
        unknown[0] = '\0';
    for (const char *p = value;; p++) {
        const char *start = p + strspn(p, " \t"), *end;
        int i;
        p = end = start + strcspn(start, ",");
        while (end > start && (end[-1] == ' ' || end[-1] == '\t'))
            end--;
        i = end > start ? oc_known_bug_index(start, (size_t)(end - start)) : -1;
        if (i >= 0) {
            bits |= 1ul << i;
        } else {
            if (used < sz)
                used += (size_t)snprintf(unknown + used, sz - used, "%s%.*s", bad ? "," : "",
                                         (int)(end - start), start);
            bad++;
        }
        if (*p == '\0')
            break;
    }
    *off = bits;
    return bad;
}

int oc_kb_foreign_device(long local_rank, int n_visible, const int *ctx, int n)
{
    /* Only when LOCAL_RANK names one of several visible devices is there a
     * "wrong" device to see. */
    if (local_rank <= 0 || n_visible <= 1 || local_rank >= n_visible || ctx == NULL)
        return -1;
    for (int i = 0; i < n; i++) {
        if (ctx[i] >= 0 && ctx[i] < n_visible && ctx[i] != local_rank)
            return ctx[i];
    }
    return -1;
}

static int oc_range_has(oc_range r, long v)
{
    return v >= r.lo && (r.hi == 0 || v < r.hi);
}

/* Appends text to why (cut to fit, always terminated). */
static void add_why(char *why, size_t sz, const char *fmt, long a, long b)
{
    size_t n;
    if (why == NULL || sz == 0)
        return;
    n = strlen(why);
    if (n + 1 >= sz)
        return;
    snprintf(why + n, sz - n, fmt, a, b);
}

static void version_text(char *buf, size_t sz, long v)
{
    snprintf(buf, sz, "%ld.%ld.%ld", v / 10000, v / 100 % 100, v % 100);
}

/* "9.x" for a whole major, else "8.6 to below 9.0". */
static void cc_text(char *why, size_t sz, oc_range r)
{
    if (r.lo % 10 == 0 && r.hi == r.lo + 10)
        add_why(why, sz, "%ld.x", r.lo / 10, 0);
    else
        add_why(why, sz, "%ld.%ld", r.lo / 10, r.lo % 10);
    if (!(r.lo % 10 == 0 && r.hi == r.lo + 10))
        add_why(why, sz, r.hi ? " to below %ld.%ld" : " or newer", r.hi / 10, r.hi % 10);
}

static const char *env_of(const oc_kb_facts *f, const char *name)
{
    return f->getenv_fn ? f->getenv_fn(name, f->ctx) : NULL;
}

/* Writes the facts' words into why (may be NULL); returns code. */
static oc_kb_code say(char *why, size_t sz, oc_kb_code code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (why != NULL && sz > 0)
        vsnprintf(why, sz, fmt, ap);
    va_end(ap);
    return code;
}

oc_kb_code oc_known_bug_decide(const oc_known_bug *b, const oc_kb_facts *f, char *why, size_t whysz)
{
    char text[32];
    int unknown = 0, cc_hit = 0;
    const char *env;
    if (why && whysz)
        why[0] = '\0';
    if (b == NULL || f == NULL)
        return OC_KBC_NEEDS_FACT;
    /* Every "no" the facts can prove wins over what is still unknown. */
    if (f->torch > 0 && !oc_range_has(b->torch, f->torch)) {
        version_text(text, sizeof text, f->torch);
        return say(why, whysz, OC_KBC_OUT_OF_RANGE, "torch %s is outside the affected releases",
                   text);
    }
    if (f->cuda_build == 0)
        return say(why, whysz, OC_KBC_NO_CUDA, "this torch build has no CUDA");
    if (!oc_range_any(b->cuda) && f->cuda > 0 && !oc_range_has(b->cuda, f->cuda))
        return say(why, whysz, OC_KBC_OUT_OF_RANGE,
                   "torch is built for CUDA %ld.%ld, outside the affected builds", f->cuda / 100,
                   f->cuda % 100);
    env = b->unless_env ? env_of(f, b->unless_env) : NULL;
    /* c10::utils::check_env: exactly "1" is true. */
    if (env != NULL && strcmp(env, "1") == 0)
        return say(why, whysz, OC_KBC_TORCH_AVOIDS, "%s=1 keeps torch off the kernel",
                   b->unless_env);
    if (b->needs & OC_KB_NEEDS_ALLOC_GENERIC) {
        if (env_of(f, OC_VAR("PYTORCH_CUDA_ALLOC_CONF")) != NULL)
            return say(why, whysz, OC_KBC_UNMET,
                       "PYTORCH_CUDA_ALLOC_CONF is set, and this release reads it");
        if (env_of(f, OC_VAR("PYTORCH_ALLOC_CONF")) == NULL)
            return say(why, whysz, OC_KBC_UNMET, "PYTORCH_ALLOC_CONF is not set");
    }
    if (b->needs & OC_KB_NEEDS_FOREIGN_CTX) {
        if (f->local_rank <= 0)
            return say(why, whysz, OC_KBC_UNMET, "%s",
                       f->local_rank < 0 ? "LOCAL_RANK is not set (no torchrun rank)"
                                         : "LOCAL_RANK 0 owns cuda:0");
        if (f->foreign_dev == -1)
            return say(why, whysz, OC_KBC_UNMET,
                       "NVML lists this process on no visible device but LOCAL_RANK %ld's",
                       f->local_rank);
    }
    if (!oc_range_any(b->cc)) {
        for (int i = 0; f->n_cc > 0 && i < f->n_cc && i < OC_KB_MAX_DEVICES; i++)
            cc_hit |= oc_range_has(b->cc, f->cc[i]);
        if (f->n_cc >= 0 && !cc_hit) {
            say(why, whysz, OC_KBC_OUT_OF_RANGE, "no visible GPU of compute capability ");
            cc_text(why, whysz, b->cc);
            return OC_KBC_OUT_OF_RANGE;
        }
    }
    if (!oc_range_any(b->cudnn) &&
        (f->cudnn == 0 || (f->cudnn > 0 && !oc_range_has(b->cudnn, f->cudnn))))
        return say(why, whysz, f->cudnn ? OC_KBC_OUT_OF_RANGE : OC_KBC_NO_CUDNN,
                   f->cudnn ? "cuDNN %ld is outside the affected versions" : "torch loads no cuDNN",
                   f->cudnn);
    if (!oc_range_any(b->nccl) && f->nccl >= 0 && !oc_range_has(b->nccl, f->nccl))
        return say(why, whysz, OC_KBC_OUT_OF_RANGE, "%s",
                   f->nccl ? "NCCL's version is outside the affected ones" : "torch loads no NCCL");
    if ((b->needs & OC_KB_NEEDS_AARCH64) && !f->aarch64)
        return say(why, whysz, OC_KBC_UNMET, "not an aarch64 machine");
    if ((b->needs & OC_KB_NEEDS_OTHER_CUDNN) && f->other_cudnn == 0)
        return say(why, whysz, OC_KBC_UNMET, "no cuDNN 9 besides the wheel's on the loader path");
    if (f->torch <= 0) {
        add_why(why, whysz, "torch's version unknown; ", 0, 0);
        unknown = 1;
    }
    if (f->cuda_build < 0) {
        add_why(why, whysz, "whether torch has CUDA unknown; ", 0, 0);
        unknown = 1;
    }
    if (!oc_range_any(b->cuda) && f->cuda <= 0) {
        add_why(why, whysz, "torch's CUDA version unknown; ", 0, 0);
        unknown = 1;
    }
    if ((b->needs & OC_KB_NEEDS_FOREIGN_CTX) && f->foreign_dev < -1) {
        add_why(why, whysz, "NVML's process list is read by status(), doctor and the summary; ", 0,
                0);
        unknown = 1;
    }
    if (!oc_range_any(b->cc) && f->n_cc < 0) {
        add_why(why, whysz, "no compute capability read (NVML); ", 0, 0);
        unknown = 1;
    }
    if (!oc_range_any(b->cudnn) && f->cudnn < 0) {
        add_why(why, whysz, "cuDNN's version is read when CUDA starts; ", 0, 0);
        unknown = 1;
    }
    if (!oc_range_any(b->nccl) && f->nccl < 0) {
        add_why(why, whysz, "NCCL's version unread; ", 0, 0);
        unknown = 1;
    }
    if ((b->needs & OC_KB_NEEDS_OTHER_CUDNN) && f->other_cudnn < 0) {
        add_why(why, whysz, "the loader path not searched for another cuDNN; ", 0, 0);
        unknown = 1;
    }
    if (unknown) {
        size_t n = why ? strlen(why) : 0;
        if (n > 1)
            why[n - 2] = '\0'; /* the last "; " */
        return OC_KBC_NEEDS_FACT;
    }
    version_text(text, sizeof text, f->torch);
    say(why, whysz, OC_KBC_APPLIES, "torch %s", text);
    if (!oc_range_any(b->cuda))
        add_why(why, whysz, ", built for CUDA %ld.%ld", f->cuda / 100, f->cuda % 100);
    if (!oc_range_any(b->cudnn))
        add_why(why, whysz, ", cuDNN %ld", f->cudnn, 0);
    if (!oc_range_any(b->cc)) {
        add_why(why, whysz, ", a visible GPU of compute capability ", 0, 0);
        cc_text(why, whysz, b->cc);
    }
    if (b->needs & OC_KB_NEEDS_ALLOC_GENERIC)
        add_why(why, whysz, ", PYTORCH_ALLOC_CONF set without PYTORCH_CUDA_ALLOC_CONF", 0, 0);
    if (!oc_range_any(b->nccl))
        add_why(why, whysz, ", NCCL %ld", f->nccl, 0);
    if (b->needs & OC_KB_NEEDS_OTHER_CUDNN)
        add_why(why, whysz, ", another cuDNN 9 on the loader path", 0, 0);
    if (b->needs & OC_KB_NEEDS_AARCH64)
        add_why(why, whysz, ", aarch64", 0, 0);
    if (b->needs & OC_KB_NEEDS_FOREIGN_CTX)
        add_why(why, whysz, ", NVML lists this process on cuda:%ld, not LOCAL_RANK %ld's",
                f->foreign_dev, f->local_rank);
    return OC_KBC_APPLIES;
}
