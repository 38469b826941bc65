/* oc.h - the one header every outofcuda C file includes.
 *
 * Two extensions. The boot (outofcuda_hook, boot.c alone) is what the
 * start-up hook loads in every process; the engine (_outofcuda, every other
 * file) is loaded by the boot on `import torch`. Read the files in the order
 * the data flows, each calling only files below it:
 *   boot.c     the finder on sys.meta_path; loads the engine for torch
 *   module.c   the engine's module definition, install(), config()
 *   watcher.c  torch's spec and the loader proxy around its import
 *   bridge.c   what happens when torch has imported: the optimisations,
 *              and the one callback queued for CUDA initialisation
 *   report.c   status dict (the IPython handler read from oom.c) and the verbose table
 *   oom.c      out-of-memory handler and report
 *   monitor.c  the native watchdog thread behind MemoryMonitor
 *   facts.c    verdicts the Python layer asks for instead of parsing again
 *   summary.c  OUTOFCUDA_SUMMARY: input-wait and utilisation sampler, at-exit block
 *   api.c      decisions behind the Python API
 *   knownbugs.c the known-bugs table applied: decided at import, at CUDA's
 *              start and from NVML; the steers, status, the summary's lines
 *   frameworks.c packages that own GPU memory (vLLM, SGLang, ...): table, detection,
 *              and the one outofcuda left GPU memory to
 *   platform.c machines where a default cannot work (expandable segments on WSL)
 *   thread.c   native threads: spawned with signals blocked, monotonic waits,
 *              fork ownership, bounded joins (monitor.c and summary.c)
 *   common.c   the shared ground: warnings and the error, the configuration,
 *              the CUDA-init steps armed, interrupts set aside, small helpers
 *   record.c   the typed record of every optimisation (pure C, no Python)
 *   advice.c   ranked advice: OOM actions and summary hints (pure C, no Python)
 *   nvml.c     NVML loaded with dlopen at run time
 *   config.c   OUTOFCUDA_* environment -> oc_config (pure C, no Python), and the
 *              one escape of outside text for terminals
 *   kbtable.c  the known-bugs table and its lookup (pure C, no Python)
 *   allocconf.c allocator-string parse and merge (pure C, no Python)
 *   settings.c the table of every environment variable read, and oc_env()
 * (tests/test_static.py holds this order against the calls in the code)
 * (below: which file owns each shared function)
 */
#ifndef OC_H
#define OC_H

#include <stddef.h>

#define OC_VERSION "0.3.0"

/* The two extensions: the boot (boot.c alone) that the start-up hook imports,
 * and the engine (every other file), loaded by the boot on `import torch`. */
#define OC_BOOT_NAME "outofcuda_hook"
#define OC_ENGINE_NAME "_outofcuda"
#define OC_ENGINE_FIND_SPEC "_find_torch_spec" /* engine function the boot's finder calls */
#define OC_ENGINE_INSTALL "install"            /* engine function for a torch already there */

/* ---- pure C part: safe to include without Python (fuzzers, unit tests) ---- */

#define OC_ALLOC_CONF_MAX 1024
#define OC_WARN_MAX 24
#define OC_WARN_LEN 768 /* the known-bug id list (16 rows, about 630 characters) fits */

/* OC_AMP_OFF: OUTOFCUDA_AMP_DTYPE set to an off word (torch's own dtype). */
typedef enum { OC_AMP_OFF = -1, OC_AMP_AUTO = 0, OC_AMP_FLOAT16, OC_AMP_BFLOAT16 } oc_amp_dtype;

/* The off words, the same for every OUTOFCUDA_* setting (any case, blanks
 * around): a boolean's false, and for every other setting the value that
 * leaves torch's own default (no step, no argument). */
#define OC_FRACTION_AUTO (-1.0)
#define OC_OFF_WORDS "0, off, false, no or none"
#define OC_WORD_MAX 32

#define OC_SUMMARY_PATH_MAX 1024
typedef enum { OC_SUMMARY_OFF = 0, OC_SUMMARY_STDERR, OC_SUMMARY_JSON } oc_summary_mode;

typedef struct {
    int disable;
    int verbose;
    int tf32;
    int cudnn_benchmark;
    int cudnn_deterministic;
    int channels_last;
    int compile;
    char compile_mode[OC_WORD_MAX];
    int compile_fullgraph;
    oc_amp_dtype amp_dtype;
    double memory_fraction; /* OC_FRACTION_AUTO: sized by the headroom (bridge.c) */
    char alloc_conf[OC_ALLOC_CONF_MAX];
    /* Defaults that join only where expandable segments end up off; empty
     * when OUTOFCUDA_ALLOC_CONF replaced outofcuda's defaults. */
    char alloc_conf_no_expandable[64];
    int framework_override; /* OUTOFCUDA_FRAMEWORK_OVERRIDE */
    int gc_collect;
    int flash_attn;
    int mem_eff_attn;
    int math_attn;
    int pin_memory;
    long num_workers;
    long prefetch_factor;
    int n_warnings;
    char warnings[OC_WARN_MAX][OC_WARN_LEN];
    oc_summary_mode summary;                /* OUTOFCUDA_SUMMARY */
    char summary_path[OC_SUMMARY_PATH_MAX]; /* the JSON file, as given */
    int known_bugs;                         /* OUTOFCUDA_KNOWN_BUGS: step around known bugs */
    /* Bit i: the setting at index i of the table was given an off word
     * (oc_config_off); its field then holds what leaves torch's default. */
    unsigned long long off;
    int oom_keep_frames;          /* OUTOFCUDA_OOM_KEEP_FRAMES: a failed cell keeps its frames */
    unsigned long known_bugs_off; /* rows (bit i: row i) OUTOFCUDA_KNOWN_BUGS turned off */
} oc_config;

/* Returns the value of an environment variable or NULL; lets tests and the
 * fuzzer feed values without touching the process environment. */
typedef const char *(*oc_getenv_fn)(const char *name, void *ctx);

/* The one table of every environment variable outofcuda reads (config.c):
 * its own OUTOFCUDA_* settings, loaded into oc_config, and the foreign ones
 * it acts on, read where they act through oc_env(). The loader, config(),
 * the warnings, the fuzz target and a docs test all come from it. */
typedef enum {
    OC_SET_BOOL,       /* int field: 1/0, true/false, yes/no, on/off */
    OC_SET_LONG,       /* long field in [lo, hi] */
    OC_SET_FRACTION,   /* double field, 0 < f <= 1 */
    OC_SET_WORD,       /* one of words: values[i] into an int field, or the word itself */
    OC_SET_ALLOC,      /* an allocator string */
    OC_SET_SUMMARY,    /* OUTOFCUDA_SUMMARY: a boolean or a .json path */
    OC_SET_TEXT,       /* read where it acts, through oc_env() (no field) */
    OC_SET_FOREIGN,    /* another program's variable, read through oc_env() */
    OC_SET_KNOWN_BUGS, /* OUTOFCUDA_KNOWN_BUGS: a boolean, or the ids of rows turned off */
} oc_setting_kind;

#define OC_NO_FIELD ((size_t)-1)
/* No max_split_size_mb beside expandable segments: inside them the
 * allocator still applies its oversize rules, so freed blocks above the
 * limit are never reused and reserved memory grows (pytorch issue 123548,
 * PR 193400). max_split_size_mb:128 joins only where expandable segments
 * end up off (config.c, bridge.c). */
#define OC_DEFAULT_ALLOC_CONF "garbage_collection_threshold:0.8,expandable_segments:True"

typedef struct {
    const char *name;
    oc_setting_kind kind;
    const char *default_text; /* NULL: unset */
    const char *accepts;      /* the values it takes, in words */
    size_t offset;            /* offsetof(oc_config, field), or (size_t)-1 */
    long lo, hi;              /* OC_SET_LONG */
    const char *const *words; /* OC_SET_WORD, NULL-terminated */
    const int *values;        /* OC_SET_WORD: words[i]'s value, or NULL */
} oc_setting;

size_t oc_setting_count(void);
const oc_setting *oc_setting_at(size_t i);            /* NULL past the end */
const oc_setting *oc_setting_named(const char *name); /* NULL when not in the table */
/* getenv() of a variable of the table; every read of the environment goes
 * through here (the boot, which links nothing, reads its two itself). */
const char *oc_env(const char *name);
/* A variable's name written anywhere but as the name argument of oc_env()
 * or a function that hands it on (oc_env_rank, oc_config_off, oc_record_off):
 * the literal itself, marked so that tests/test_static.py can hold every name
 * to the table. */
#define OC_VAR(name) name
/* A torchrun rank variable of the table (RANK, LOCAL_RANK) as a whole number
 * from 0 (below a million, the largest job's ranks); -1 when unset, empty or
 * anything else. Where LOCAL_RANK names a device, one past the devices counts
 * as absent at the caller. */
long oc_env_rank(const char *name);
/* This process's rank in a torchrun job: RANK, else LOCAL_RANK, else -1. */
long oc_job_rank(void);
/* The label every line outofcuda prints starts with: "[rank N] " in a
 * process torchrun started (RANK, else LOCAL_RANK), "[launcher] " in
 * torchrun's own launcher process, else "". Static storage. */
const char *oc_rank_label(void);
/* 1 in torchrun's launcher (its command line, and no RANK/LOCAL_RANK). */
int oc_torchrun_launcher(void);

/* Fills *cfg from the environment; never fails. Every bad value leaves the
 * default in place and appends one message to cfg->warnings. */
void oc_config_load(oc_config *cfg, oc_getenv_fn getenv_fn, void *ctx);
/* Adds a warning to cfg for every OUTOFCUDA_* name in env (environ's
 * layout) that the table of settings does not have, naming the closest one. */
void oc_config_check_names(oc_config *cfg, char *const *env);

/* Copies at most max characters of text that came from outside the process
 * (a variable's name or value, another process's name, a driver's answer)
 * into out, so that no renderer hands a terminal an escape sequence or text
 * that reorders what follows: control characters and bytes that begin no
 * UTF-8 character as \xNN, bidi controls and zero-width or invisible
 * characters as \uXXXX, the rest as it is; "..." after it when more than
 * max characters were there; cut between characters to fit outsz. oc_escape_controls does it in
 * place (up to 511 bytes). */
void oc_escape_text(const char *text, char *out, size_t outsz, size_t max);
void oc_escape_controls(char *buf, size_t sz);

/* Parses a boolean word (1, true, yes, on; or an off word of OC_OFF_WORDS;
 * any case, spaces around allowed). Returns 1 or 0, or -1 when the word is
 * none of those. */
int oc_parse_bool(const char *s);
/* 1 when s is one of OC_OFF_WORDS. */
int oc_parse_off(const char *s);
/* 1 when the environment gave the setting `name` an off word (the user
 * turned it off), else 0. */
int oc_config_off(const oc_config *cfg, const char *name);

/* Allocator configuration strings: "key:value,key:value" where a value may
 * hold a bracketed list with commas ("[256:1,>:4]"). */
#define OC_ALLOC_ENTRIES_MAX 32
typedef struct {
    int n;
    struct {
        char key[64];
        char value[256];
    } e[OC_ALLOC_ENTRIES_MAX];
} oc_alloc_list;

/* Parses s into *out. Returns 0 on success, -1 when s is malformed (message
 * written to err, which may be NULL). An empty or blank string is valid. */
int oc_alloc_parse(const char *s, oc_alloc_list *out, char *err, size_t errsz);

/* Returns 1 when key is a key that this torch release accepts. */
typedef int (*oc_key_allowed_fn)(const char *key, void *ctx);

/* Writes user entries first (all kept: they are the user's), then every default
 * entry whose key the user did not set and `allowed` accepts (NULL: all).
 * Keys of defaults that were dropped as unknown go to `dropped` (comma list).
 * Returns 0, or -1 when a string is malformed or the output does not fit. */
int oc_alloc_merge(const char *defaults, const char *user, oc_key_allowed_fn allowed, void *ctx,
                   char *out, size_t outsz, char *dropped, size_t droppedsz, char *err,
                   size_t errsz);

/* The value of `key` in an allocator string into value: 1 found, 0 absent,
 * -1 malformed. A key given twice holds its last value, as torch applies
 * it (oc_alloc_parse keeps one entry). */
int oc_alloc_value(const char *conf, const char *key, char *value, size_t valuesz);

/* Returns 1 when the allocator string sets key to value (blanks around
 * ignored), else 0 (also for a malformed string). */
int oc_alloc_has(const char *conf, const char *key, const char *value);

/* Returns 1 when the allocator string turns expandable segments on. */
int oc_alloc_expandable(const char *conf);

/* max_split_size_mb beside expandable segments. Inside them torch still
 * applies max_split_size's oversize rules, so freed blocks above it are not
 * reused and reserved memory keeps growing (pytorch issue 123548): the
 * doctor flags OC_SPLIT_INSIDE_EXPANDABLE, and the merge gives a string in
 * OC_SPLIT_NO_EXPANDABLE no expandable segments from the defaults. */
typedef enum {
    OC_SPLIT_NONE,              /* no max_split_size_mb (or a malformed string) */
    OC_SPLIT_INSIDE_EXPANDABLE, /* max_split_size_mb with expandable_segments:True */
    OC_SPLIT_NO_EXPANDABLE,     /* max_split_size_mb, expandable_segments not named */
} oc_split_rule;
oc_split_rule oc_alloc_split_rule(const char *conf);

/* outofcuda's merge of its defaults under the user's string (the user's keys
 * win, as oc_alloc_merge): the defaults' expandable_segments is left out
 * when the user's string sets max_split_size_mb without naming
 * expandable_segments (*held_back = 1), and `no_expandable` joins as a
 * default only when the result does not turn expandable segments on.
 * Returns 0, or -1 as oc_alloc_merge. */
int oc_alloc_merge_defaults(const char *defaults, const char *no_expandable, const char *user,
                            oc_key_allowed_fn allowed, void *ctx, char *out, size_t outsz,
                            char *dropped, size_t droppedsz, char *err, size_t errsz,
                            int *held_back);

/* torch release number from a version string ("2.9.1+cu128" -> 20901). Returns
 * 0 when it cannot be read. */
long oc_torch_version_number(const char *version);

/* Returns 1 when the allocator key exists in the torch release `ver`
 * (oc_torch_version_number) for a CUDA build. */
int oc_alloc_key_known(const char *key, long ver);

/* Returns the name of the environment variable the release reads first. */
const char *oc_alloc_env_name(long ver);
/* 1 when release ver's CUDA allocator ignores the PYTORCH_ALLOC_CONF the
 * user set (2.9 and 2.10 read PYTORCH_CUDA_ALLOC_CONF alone, pytorch issue
 * 183387) and PYTORCH_CUDA_ALLOC_CONF is unset; its value through *value. */
int oc_alloc_generic_ignored(long ver, const char **value);

/* knownbugs.c: bugs of the installed stack and what outofcuda does about
 * them. A range holds lo <= v < hi (hi 0: no upper bound). */
typedef struct {
    long lo, hi;
} oc_range;

/* {0, 0}: the row holds whatever the fact is (it needs no such fact). */
static inline int oc_range_any(oc_range r)
{
    return r.lo == 0 && r.hi == 0;
}

/* What outofcuda does about a row: a steer that costs nothing, or a line in
 * status(), `outofcuda doctor` and the exit summary (OC_KB_REPORT). */
typedef enum {
    OC_KB_SDPA_NO_CUDNN = 1, /* cuDNN attention off when CUDA starts */
    OC_KB_ALLOC_GENERIC,     /* the user's PYTORCH_ALLOC_CONF handed to torch's setter */
    OC_KB_TF32_LEGACY,       /* TF32 set only through the legacy setter (both APIs agree) */
    OC_KB_REPORT,            /* named, with the versions and the fix */
} oc_kb_action;

/* Facts a row needs beside torch's version and build. */
#define OC_KB_NEEDS_ALLOC_GENERIC 1u /* PYTORCH_ALLOC_CONF set, PYTORCH_CUDA_ALLOC_CONF not */
#define OC_KB_NEEDS_FOREIGN_CTX 2u   /* NVML lists this process on another rank's device */
#define OC_KB_NEEDS_OTHER_CUDNN 4u   /* a cuDNN 9 besides the wheel's on the loader path */
#define OC_KB_NEEDS_AARCH64 8u       /* an aarch64 machine */

typedef struct {
    const char *id;
    const char *title;
    oc_range torch;         /* oc_torch_version_number */
    oc_range cudnn;         /* torch.backends.cudnn.version() (runtime); {0, 0}: any, none needed */
    oc_range cc;            /* compute capability major*10+minor, any visible GPU; {0, 0}: any */
    const char *unless_env; /* torch itself avoids the bug when this is "1", or NULL */
    const char *condition;  /* what else must hold, in words */
    oc_kb_action action;
    unsigned needs; /* OC_KB_NEEDS_* */
    const char *action_text;
    const char *evidence; /* a link */
    oc_range cuda;        /* torch.version.cuda as major*100+minor; {0, 0}: any */
    const char *fixed_in; /* the first torch/cuDNN release with the fix, or NULL (none yet) */
    const char *fix;      /* what the user can do, in words */
    oc_range nccl;        /* NCCL as major*10000+minor*100+patch; {0, 0}: any */
} oc_known_bug;

size_t oc_known_bug_count(void);
const oc_known_bug *oc_known_bug_at(size_t i); /* NULL past the end */
/* The row called id (exactly, or up to len characters when len > 0), or -1. */
int oc_known_bug_index(const char *id, size_t len);
/* OUTOFCUDA_KNOWN_BUGS as a list of row ids separated by commas (blanks
 * around each allowed): the rows it names as bits in *off, and the entries
 * that name no row (an empty one too) in unknown, separated by commas (cut
 * to fit sz). Returns how many entries name no row; -1 for NULL. */
int oc_known_bugs_parse_off(const char *value, unsigned long *off, char *unknown, size_t sz);

#define OC_KB_MAX_DEVICES 64
#define OC_KB_MAX_ENTRIES 24
/* What outofcuda knows of the stack; unknown facts are negative. */
typedef struct {
    long torch;     /* oc_torch_version_number; 0 unknown */
    int cuda_build; /* 1, 0, -1 unknown */
    long cudnn;     /* cuDNN (runtime, else the wheel's); 0 none; -1 not read (yet) */
    int n_cc;       /* visible GPUs' compute capabilities in cc; -1 unknown */
    int cc[OC_KB_MAX_DEVICES];
    oc_getenv_fn getenv_fn; /* NULL: no variable is set */
    void *ctx;
    long cuda;       /* torch.version.cuda as major*100+minor; 0 unknown */
    long local_rank; /* LOCAL_RANK; -1 unset */
    int foreign_dev; /* a device NVML lists this process on that is not LOCAL_RANK's;
                        -1 none, -2 not read */
    long nccl;       /* the NCCL torch loads; 0 none; -1 not read */
    int other_cudnn; /* a cuDNN 9 besides the wheel's on the loader path: 1, 0, -1 unknown */
    int aarch64;     /* 1 on an aarch64 machine */
} oc_kb_facts;

/* The device index NVML lists this process on that is not LOCAL_RANK's:
 * ctx holds the CUDA-visible indices it is listed on (n of them) out of
 * n_visible. -1 when none is (or when which device is LOCAL_RANK's cannot
 * be told: one visible device, or LOCAL_RANK beyond the visible ones). */
int oc_kb_foreign_device(long local_rank, int n_visible, const int *ctx, int n);

#define OC_KB_NO 0
#define OC_KB_YES 1
#define OC_KB_UNDECIDED (-1)
/* Why a row's verdict is what it is (status()'s "code"); the verdict
 * follows from the code (oc_kb_verdict). */
#define OC_KB_CODES(X)                                                                             \
    X(APPLIES, "applies")           /* every fact the row names holds */                           \
    X(AVOIDED, "avoided")           /* outofcuda's steer or own settings avoid it */               \
    X(NOT_AVOIDED, "not_avoided")   /* the steer could not act (the reason says) */                \
    X(OUT_OF_RANGE, "out_of_range") /* a version or capability outside the row's */                \
    X(NO_CUDA, "no_cuda")           /* a torch build without CUDA */                               \
    X(NO_CUDNN, "no_cudnn")         /* torch loads no cuDNN */                                     \
    X(TORCH_AVOIDS, "torch_avoids") /* the row's variable keeps torch off the bug */               \
    X(UNMET, "condition_unmet")     /* a variable or rank it needs is not so */                    \
    X(NEEDS_FACT, "needs_fact")     /* a fact it needs is not read (yet) */                        \
    X(OFF, "off")                   /* OUTOFCUDA_KNOWN_BUGS or _DISABLE */                         \
    X(NOT_IMPORTED, "not_imported") /* torch not imported through the hook */
#define OC_KB_CODE_ENUM(id, name) OC_KBC_##id,
typedef enum { OC_KB_CODES(OC_KB_CODE_ENUM) OC_KB_CODE_COUNT } oc_kb_code;
#undef OC_KB_CODE_ENUM
static inline int oc_kb_verdict(oc_kb_code code) /* the codes run in the verdicts' order */
{
    return code <= OC_KBC_NOT_AVOIDED ? OC_KB_YES
           : code <= OC_KBC_UNMET     ? OC_KB_NO
                                      : OC_KB_UNDECIDED;
}
/* Whether bug b applies to facts f, as a code: OC_KBC_APPLIES, one that
 * rules it out, or OC_KBC_NEEDS_FACT. why (may be NULL) gives the facts. */
oc_kb_code oc_known_bug_decide(const oc_known_bug *b, const oc_kb_facts *f, char *why,
                               size_t whysz);
/* The allocator variable the CUDA allocator of release `ver` reads, as torch
 * reads it: up to 2.10 PYTORCH_CUDA_ALLOC_CONF only; from 2.11 the first set
 * of PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF, PYTORCH_ALLOC_CONF wins
 * whole, and an empty value counts as set (c10::utils::get_env returns it;
 * CUDAAllocatorConfig::instance() stops at the first that has a value,
 * measured on 2.14.1). Returns the name (where outofcuda writes; the
 * release's first name when none is set) and its value through *value (NULL
 * when unset). */
const char *oc_alloc_user_var(long ver, const char **value);
/* The allocator variables in the order torch 2.11+ reads them; NULL past the
 * end. */
const char *oc_alloc_var_at(size_t i);

/* Returns 1 when NVIDIA_TF32_OVERRIDE's value v (NULL: unset) forces TF32
 * off in NVIDIA's libraries: "0", C-locale blanks around allowed. */
int oc_tf32_forced_off(const char *v);

/* record.c: one typed record per optimisation, the one account of what
 * outofcuda did. Each file that decides an optimisation writes its record
 * through the functions below; status(), the verbose table and the CLI render
 * from it, and what another file needs of it (the fraction, the device, the
 * allocator string, the autocast dtype) it reads from the typed fields, never
 * from the sentence. A row names torch._C's setter and getter of a plain
 * flag (status() reads "now" through the getter), and a plain flag's
 * variable and what it does when on: bridge.c sets such a flag at import,
 * with no function of its own. */
#define OC_OPTIMISATIONS(X)                                                                        \
    X(TF32, "tf32", NULL, NULL, NULL, NULL)                                                        \
    X(CUDNN_BENCHMARK, "cudnn_benchmark", "_set_cudnn_benchmark", "_get_cudnn_benchmark",          \
      OC_VAR("OUTOFCUDA_CUDNN_BENCHMARK"),                                                         \
      "autotunes convolutions per input shape (slow with changing shapes)")                        \
    X(CUDNN_DETERMINISTIC, "cudnn_deterministic", "_set_cudnn_deterministic",                      \
      "_get_cudnn_deterministic", NULL, NULL) /* forces the autotuner off: bridge.c's own */       \
    X(ALLOCATOR, "allocator", NULL, NULL, NULL, NULL)                                              \
    X(FRACTION, "memory_fraction", NULL, NULL, NULL, NULL)                                         \
    X(SDPA, "sdpa", NULL, NULL, NULL, NULL)                                                        \
    X(AMP_DTYPE, "amp_dtype", NULL, NULL, NULL, NULL)                                              \
    X(OOM, "oom_handler", NULL, NULL, NULL, NULL)
#define OC_OPT_ENUM(id, name, setter, getter, var, does) OC_OPT_##id,
typedef enum { OC_OPTIMISATIONS(OC_OPT_ENUM) OC_OPT_COUNT } oc_opt;
#undef OC_OPT_ENUM

/* Where an optimisation stands. pending: nothing decided yet (torch not
 * imported through the hook); queued: decided, waits for CUDA's start;
 * interrupted: its step at CUDA's start was interrupted and runs again
 * when torch next runs its queue. */
#define OC_REC_STATES(X)                                                                           \
    X(PENDING, "pending")                                                                          \
    X(QUEUED, "queued")                                                                            \
    X(APPLIED, "applied")                                                                          \
    X(SKIPPED, "skipped")                                                                          \
    X(FAILED, "failed")                                                                            \
    X(INTERRUPTED, "interrupted")
#define OC_STATE_ENUM(id, name) OC_REC_##id,
typedef enum { OC_REC_STATES(OC_STATE_ENUM) OC_REC_STATE_COUNT } oc_rec_state;
#undef OC_STATE_ENUM

/* Why, as a stable code (status()["optimizations"][name]["code"]); the
 * sentence beside it is for people and may change. */
#define OC_REC_CODES(X)                                                                            \
    X(NOT_IMPORTED, "not_imported")       /* torch not imported in this process yet */             \
    X(IMPORT_BYPASSED, "import_bypassed") /* a finder ahead of the hook loaded torch */            \
    X(NO_HOOK, "no_hook")                 /* the start-up hook did not run */                      \
    X(NOT_PYTORCH, "not_pytorch")         /* the imported `torch` has no torch._C */               \
    X(IMPORTED_EARLY, "imported_early")   /* torch imported before the hook installed */           \
    X(OFF, "off")         /* off_by (OUTOFCUDA_DISABLE or a switch) turned it off */               \
    X(NO_CUDA, "no_cuda") /* a torch build without CUDA */                                         \
    X(ROCM, "rocm")       /* a ROCm build: CUDA's allocator only */                                \
    X(VERSION_UNKNOWN, "version_unknown") /* torch's version unread before it loaded */            \
    X(NO_SETTER, "no_setter")             /* this torch lacks the function */                      \
    X(SETTER_FAILED, "setter_failed")     /* torch's function raised */                            \
    X(NO_QUEUE, "no_queue")               /* this torch has no torch.cuda._lazy_call */            \
    X(QUEUE_FAILED, "queue_failed")       /* torch.cuda._lazy_call raised */                       \
    X(AT_CUDA_INIT, "at_cuda_init")       /* waits for, or was done at, CUDA's start */            \
    X(PROGRAM_CHOSE, "program_chose")     /* the program chose first: its choice wins */           \
    X(UNREADABLE, "unreadable")           /* what the program chose cannot be read */              \
    X(FLAGS_FROZEN, "flags_frozen")       /* torch.backends.disable_global_flags() */              \
    X(TF32_OVERRIDE, "tf32_override")     /* NVIDIA_TF32_OVERRIDE=0 */                             \
    X(USER_SETTING, "user_setting")       /* an OUTOFCUDA_* value asked for it */                  \
    X(DEFAULT, "default")                 /* outofcuda's default */                                \
    X(TORCH_DEFAULT, "torch_default")     /* torch's default is what is wanted: not written */     \
    X(DETERMINISTIC, "deterministic")     /* forced off by deterministic cuDNN */                  \
    X(FRAMEWORK, "framework")             /* left to a framework that owns GPU memory */           \
    X(FRAMEWORK_LEFT, "framework_left")   /* that framework was gone when CUDA started */          \
    X(HANDED_BACK, "handed_back")         /* the user's allocator string given back */             \
    X(NOT_UNDERSTOOD, "not_understood")   /* the user's allocator string does not parse */         \
    X(NOTHING_TO_ADD, "nothing_to_add")   /* the user's allocator string has it all */             \
    X(RUNTIME_SETTER, "runtime_setter")   /* given to torch's runtime allocator setter */          \
    X(ENV_WRITTEN, "env_written")         /* the allocator variable written while torch loaded */  \
    X(DTYPE_UNKNOWN, "dtype_unknown")     /* auto: no compute capability to decide from */         \
    X(NO_OBSERVER, "no_observer")         /* this torch has no CUDA OOM observer */                \
    X(NO_OOM_TYPE, "no_oom_type")         /* this torch has no torch.cuda.OutOfMemoryError */      \
    X(ERROR, "error")                     /* failed inside outofcuda (status()["error"]) */
#define OC_CODE_ENUM(id, name) OC_CODE_##id,
typedef enum { OC_REC_CODES(OC_CODE_ENUM) OC_REC_CODE_COUNT } oc_rec_code;
#undef OC_CODE_ENUM

/* Which typed field is the record's value (status()'s "value"). */
typedef enum {
    OC_VAL_NONE,     /* None */
    OC_VAL_BOOL,     /* flag */
    OC_VAL_MATMUL,   /* {"matmul": flag} */
    OC_VAL_SDPA,     /* {"flash", "mem_efficient", "math"}: sdpa[] */
    OC_VAL_TEXT,     /* text: the allocator string, the autocast dtype */
    OC_VAL_FRACTION, /* {"fraction", "device"}: device -1 until CUDA starts */
    OC_VAL_OOM,      /* {"hooks", "observer", "snapshot", "ipython"}: oom */
} oc_rec_value;

/* A known cost of a choice: a stable id, its words, and the two ways back
 * (status()'s "cost": {"id", "ways_back"}); the record's sentence ends with
 * the words and the ways back. */
typedef struct {
    const char *id, *words, *ways_back[2];
} oc_cost;
typedef enum { OC_COST_NONE, OC_COST_BF16_CONV } oc_cost_id;

#define OC_REASON_LEN 2000
typedef struct {
    const char *off_by; /* the OUTOFCUDA_* variable of OC_CODE_OFF (static), else NULL */
    oc_cost_id cost;    /* a known cost of the choice (oc_record_cost) */
    /* The sdpa record: what the cuDNN-attention guard did (static text) and
     * the known bug's id, or NULL: cuDNN attention left as torch has it. */
    const char *guard, *guard_id;
    double fraction;
    long device;
    oc_rec_state state;
    oc_rec_code code;
    oc_rec_value kind;
    int flag;
    int sdpa[3];
    /* The allocator: the user's PYTORCH_ALLOC_CONF, which 2.9 and 2.10
     * ignore, went to torch in outofcuda's string (known bug
     * alloc-conf-generic-ignored avoided). */
    int alloc_generic;
    struct {
        const char *hooks; /* static text */
        char observer[400];
        char snapshot[4096]; /* "" none */
    } oom;
    char reason[OC_REASON_LEN];
    char text[OC_ALLOC_CONF_MAX];
} oc_record;

const char *oc_opt_name(oc_opt opt);
/* An optimisation's row: its name, torch._C's setter and getter of a plain
 * flag, and a plain flag's variable and what it does (NULL where none). */
typedef struct {
    const char *name, *setter, *getter, *var, *does;
} oc_opt_row;
const oc_opt_row *oc_opt_row_of(oc_opt opt);
const char *oc_rec_state_name(oc_rec_state state);
const char *oc_rec_code_name(oc_rec_code code);
/* The record of opt (read-only: every write goes through the functions
 * below); NULL for an opt out of range. */
const oc_record *oc_record_get(oc_opt opt);
/* Writes opt's state, code and sentence (printf format); the value becomes
 * None, off_by NULL. The typed fields the setters below fill stay. */
void oc_record_set(oc_opt opt, oc_rec_state state, oc_rec_code code, const char *fmt, ...)
#ifdef __GNUC__
    __attribute__((format(printf, 4, 5)))
#endif
    ;
/* opt is off by the user's variable var (static): skipped, OC_CODE_OFF. */
void oc_record_off(oc_opt opt, const char *var);
/* Every record: state, code and reason. */
void oc_record_set_all(oc_rec_state state, oc_rec_code code, const char *reason);
void oc_record_bool(oc_opt opt, int value);
void oc_record_matmul(int tf32);
void oc_record_sdpa(int flash, int mem_efficient, int math);
void oc_record_text(oc_opt opt, const char *text);
void oc_record_fraction(double fraction, long device);
void oc_record_alloc_generic(int handed);
/* The OOM handler's value; NULL leaves a field as it was. */
void oc_record_oom(const char *hooks, const char *observer, const char *snapshot);
void oc_record_sdpa_guard(const char *what, const char *id);
void oc_record_cost(oc_opt opt, oc_cost_id cost);
const oc_cost *oc_cost_get(oc_cost_id cost); /* NULL for OC_COST_NONE */
/* The sentence status() shows: the writer's, with the sdpa guard's words. */
void oc_record_reason(oc_opt opt, char *buf, size_t sz);

/* advice.c: ranked advice. Each rule that fits the figures adds an item;
 * items are ranked by score (higher first), ties by order (lower first). */
#define OC_ADVICE_LEN 400
#define OC_GIB (1024.0 * 1024.0 * 1024.0)
typedef struct {
    double score;
    int order;
    char text[OC_ADVICE_LEN];
} oc_advice_item;
/* "512 MiB" under a GiB, else "1.50 GiB". */
void oc_fmt_bytes(unsigned long long b, char *buf, size_t sz);

/* Figures of one CUDA OOM as oc_oom_advise reads them; 0 means unknown for
 * byte counts. */
#define OC_OOM_OTHERS_MAX 8
typedef struct {
    unsigned long long request, total, limit, allocated, reserved, inactive_split;
    double fraction;        /* 0 when no fraction is set */
    int expandable;         /* expandable_segments is on */
    int no_expandable_here; /* they cannot work on this platform (WSL): never advised */
    int autocast;           /* 1 on, 0 off, -1 unknown */
    int exhausted;          /* auto_microbatch already split down to min_size */
    int n_others;
    struct {
        unsigned int pid;
        char name[64];
        unsigned long long used;
    } others[OC_OOM_OTHERS_MAX]; /* other processes on the GPU */
} oc_oom_figures;
/* Fills out[] (room for max) with the actions that fit f, most useful first
 * (the bytes each would give back, where known). Returns how many. */
int oc_oom_advise(const oc_oom_figures *f, oc_advice_item *out, int max);

/* One device's figures at exit as oc_summary_hints reads them. */
#define OC_SUMMARY_LOW_UTIL 50 /* percent: a sample under it counts as "under 50 %" */
typedef struct {
    unsigned long long util_samples, under_low, mem_samples, mem_peak, mem_total;
    double util_sum;                         /* percent, summed over util_samples */
    long long peak_allocated, peak_reserved; /* torch's; -1 unknown */
    long workers;           /* num_workers of the DataLoader the main thread waited in, else the
                     largest alive at exit; -1 none */
    int expandable;         /* expandable_segments is on */
    int no_expandable_here; /* they cannot work on this platform (WSL): never advised */
    /* The input wait: samples of the main thread's stack, and of them those
     * inside a torch.utils.data iterator; utilisation samples taken with a
     * stack sample, and of them those under 50 % while the main thread waited. */
    unsigned long long frame_samples, frame_waits, paired_samples, paired_wait_low;
    long cpus, suggested_workers; /* usable cores; the num_workers smart_dataloader picks */
} oc_summary_figures;
#define OC_SUMMARY_STARVED_SHARE 0.10  /* waited on data this share of the samples: starved */
#define OC_SUMMARY_MIN_FRAME_SAMPLES 5 /* fewer stack samples measure no wait */
/* 1 when the main thread waited on data for OC_SUMMARY_STARVED_SHARE of
 * enough samples (the input-pipeline hint and the JSON's "starved"). */
int oc_summary_starved(const oc_summary_figures *d);
/* Fills out[] (room for max) with the hints that fit d, highest score
 * first. Returns how many (at most 3). */
int oc_summary_hints(const oc_summary_figures *d, oc_advice_item *out, int max);

#ifndef OC_PURE_C
/* ---- Python part ---- */
#ifndef Py_LIMITED_API
#error "outofcuda builds against the Limited API only"
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <elf.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* OC_ABI3T: the experimental build for PEP 803's abi3t (3.15+, one file for
 * the GIL-enabled and the free-threaded interpreter). PyObject is opaque
 * there, so an object's own fields live in its type's data (a negative
 * basic size) and are reached through PyObject_GetTypeData. */
#ifdef OC_ABI3T
#define OC_OBJECT_HEAD
#define OC_FIELDS(type, obj) ((type *)PyObject_GetTypeData((obj), Py_TYPE(obj)))
#define OC_BASICSIZE(type) (-(int)sizeof(type))
/* The slots both export hooks end with: the ABI they were built for, and
 * the GIL they rely on (the free-threaded interpreter never reads it: the
 * hooks refuse there, through oc_export). */
#define OC_EXPORT_COMMON_SLOTS(abi)                                                                \
    PySlot_DATA(Py_mod_abi, &(abi)), PySlot_DATA(Py_mod_gil, Py_MOD_GIL_USED)
#else
#define OC_OBJECT_HEAD PyObject_HEAD
#define OC_FIELDS(type, obj) ((type *)(obj))
#define OC_BASICSIZE(type) ((int)sizeof(type))
#endif

/* Both extensions are built for the GIL-enabled ABI. A free-threaded
 * interpreter (sys.abiflags holds "t": 3.13t, 3.14t, 3.15t) lays objects out
 * differently and would re-enable the GIL for the whole process to load a
 * module that does not declare Py_mod_gil, so each init refuses there
 * before it touches an object. Hence only calls into the interpreter here,
 * no inline reference counting (Py_DecRef is a function), and a bare
 * PyErr_Clear: neither extension's trace may run before the check. */
#define OC_FREE_THREADED_REFUSAL                                                                   \
    "outofcuda stays out of free-threaded Python: it is built for the GIL-enabled interpreter"
static inline int oc_free_threaded_interpreter(void)
{
    PyObject *flags = PySys_GetObject("abiflags"); /* borrowed; absent on older Windows */
    PyObject *t;
    int r = 0;
    if (flags == NULL)
        return 0;
    t = PyUnicode_FromString("t");
    if (t != NULL)
        r = PyUnicode_Contains(flags, t);
    Py_DecRef(t);
    if (r < 0)
        PyErr_Clear(); /* flags that are not a str mark no free-threaded build */
    return r == 1;
}

#ifdef OC_ABI3T
/* An export hook's answer: its slots, or NULL with the refusal. */
static inline PySlot *oc_export(PySlot *slots)
{
    if (oc_free_threaded_interpreter()) {
        PyErr_SetString(PyExc_ImportError, OC_FREE_THREADED_REFUSAL);
        return NULL;
    }
    return slots;
}
#endif

/* The steps of the one callback on torch's lazy-init queue (bridge.c), in
 * the order it runs them, each with the name status()["cuda_init"] gives it. */
#define OC_CUDA_STEPS(X)                                                                           \
    X(FRAMEWORK, "framework")                                                                      \
    X(TF32, "tf32")                                                                                \
    X(FRACTION, "memory_fraction")                                                                 \
    X(KNOWN_BUGS, "known_bugs")                                                                    \
    X(OOM, "oom_handler")                                                                          \
    X(SUMMARY, "summary")
#define OC_STEP_ENUM(id, name) OC_STEP_##id,
typedef enum { OC_CUDA_STEPS(OC_STEP_ENUM) OC_STEP_COUNT } oc_cuda_step;
#undef OC_STEP_ENUM

/* The engine's state. Each file keeps its own, in file-level statics beside
 * the code that uses it, and what another file needs is behind a function of
 * the lower of the two (a file above tells a file below, or asks it):
 * tests/test_static.py holds that no file names another's variable. The
 * state is process-wide by nature, not per module object: the hook fires
 * once per process whatever imports torch, CUDA starts once per process, and
 * the callbacks torch and the interpreter call (the lazy-init queue, the OOM
 * observer, the exception hooks, atexit) receive no module to find
 * per-module state through. Every such variable is read and written with the
 * GIL held; the native threads (monitor.c's watchdogs, summary.c's sampler)
 * run without it and guard what they share with their own locks, and NVML
 * (nvml.c) is loaded once behind pthread_once. Function-local statics are
 * scratch buffers for one call under the GIL, or a variable read once
 * (OUTOFCUDA_DEBUG). */

/* What is armed for CUDA's start (common.c): one bit per oc_cuda_step, set
 * at import by the file that owns the step, cleared by bridge.c's callback as
 * each step completes (an interrupted step stays armed and runs again when
 * torch runs its queue again), and cleared whole when the callback cannot be
 * queued. */
void oc_cuda_step_arm(oc_cuda_step step); /* the callback runs it when CUDA starts */
unsigned oc_cuda_steps_armed(void);       /* bit i: step i armed */
void oc_cuda_steps_set_armed(unsigned steps);
/* A run of the step ended: completed (done, no longer armed), or
 * interrupted (it stays as the caller left the armed steps). */
void oc_cuda_step_ran(oc_cuda_step step, int interrupted);
/* Where a step stands, with the word status()["cuda_init"] gives it: off
 * (nothing to do when CUDA starts), queued (armed, waiting for CUDA's
 * start), interrupted (its last run was; it runs again when torch next runs
 * its queue), done (it ran to the end). */
#define OC_STEP_STATES(X)                                                                          \
    X(OFF, "off")                                                                                  \
    X(QUEUED, "queued")                                                                            \
    X(INTERRUPTED, "interrupted")                                                                  \
    X(DONE, "done")
#define OC_STEP_STATE_ENUM(id, name) OC_STEP_IS_##id,
typedef enum { OC_STEP_STATES(OC_STEP_STATE_ENUM) OC_STEP_STATE_COUNT } oc_step_state;
#undef OC_STEP_STATE_ENUM
oc_step_state oc_cuda_step_state(oc_cuda_step step);

/* common.c */
const oc_config *oc_config_get(void); /* loads once, emits warnings */
void oc_warn(const char *msg);        /* one warning; never raises */
/* The configuration when it has been loaded, else NULL (loads nothing). */
const oc_config *oc_config_if_loaded(void);
/* Writes through sys.stderr only: nothing when it is None or closed. */
void oc_stderr_write(const char *text);
/* text with the rank label before each line starting in it (malloc'd), or
 * NULL where there is no label; *at_start carries "at a line's start". */
char *oc_labelled(const char *text, int *at_start);
void oc_stderr_printf(const char *fmt, ...)
#ifdef __GNUC__
    __attribute__((format(printf, 1, 2)))
#endif
    ;
void oc_set_error(const char *where); /* keeps the current exception text */
/* The first error oc_set_error kept (a str, borrowed), or NULL. */
PyObject *oc_error(void);
/* Swallows the current exception, leaving a trace under OUTOFCUDA_DEBUG=1
 * that names why (NULL: an error given up); a KeyboardInterrupt or
 * SystemExit is set aside instead. Every exception the engine swallows goes
 * through one of the three macros, each saying why (tests/test_static.py
 * holds it): */
void oc_clear_at(const char *file, int line, const char *func, const char *why);
/* an error outofcuda gives up on so that the program goes on */
#define OC_CLEAR() oc_clear_at(__FILE__, __LINE__, __func__, NULL)
/* absence is the expected answer: a missing attribute, a key already gone */
#define OC_CLEAR_ABSENT() oc_clear_at(__FILE__, __LINE__, __func__, "absent")
/* what it clears is already recorded or reported (a step's reason, stderr) */
#define OC_CLEAR_RECORDED() oc_clear_at(__FILE__, __LINE__, __func__, "recorded")
/* Raises the KeyboardInterrupt or SystemExit that oc_clear_at or
 * oc_set_error set aside in this thread: -1 with it set (it replaces an
 * exception already set), else 0. The edge's leave step (below). */
int oc_raise_interrupt(void);
/* 1 when this thread has a KeyboardInterrupt or SystemExit set aside. */
int oc_interrupt_waiting(void);
/* The interrupt set aside in this thread, taken out of the thread's state
 * so that no edge raises it (new reference), or NULL when none waits. */
PyObject *oc_interrupt_take(void);
/* Sets what oc_interrupt_take gave aside again in this thread (the reference
 * is stolen), for the next edge to raise: 0; or, where it cannot be kept,
 * -1 with it raised now. */
int oc_interrupt_put_back(PyObject *taken);

/* ---- the edge ----
 * Every C function of the engine that CPython calls (a method table's
 * function, a callback handed to torch or the interpreter, a slot of the
 * loader proxy, the module's exec) is called through a wrapper the compiler
 * makes: the macro of its calling convention, written after fn (or after its
 * prototype), defines edge_<fn>, which calls fn and then leaves through
 * oc_raise_interrupt, so an interrupt set aside while fn ran reaches its
 * caller as fn returns. fn may return NULL (or -1) with no exception set
 * while an interrupt waits: its wrapper raises that one. A table names fn
 * through OC_METHOD, OC_SLOT or OC_GETTER, which take the wrapper and the
 * flags or slot its macro gave, so the two cannot disagree, and CPython
 * checks the arguments itself, with the messages of any built-in. Only what
 * cannot raise stays bare: the dealloc, traverse and clear slots, a
 * capsule's destructor (tests/test_static.py holds every table and callback
 * of the engine to this).
 *     OC_EDGE_O(py_nvml_index)
 *     PyMethodDef oc_nvml_methods[] = {OC_METHOD("nvml_index", py_nvml_index, doc), ...};
 */
PyObject *oc_leave(PyObject *result); /* result, or NULL (result released) with the interrupt */
/* clang-format off */
#define OC_EDGE_OBJECT(fn, params, args)                                                           \
    static PyObject *edge_##fn params                                                              \
    {                                                                                              \
        return oc_leave(fn args);                                                                  \
    }
#define OC_EDGE_NUMBER(type, fn, params, args)                                                     \
    static type edge_##fn params                                                                   \
    {                                                                                              \
        type result = fn args;                                                                     \
        return oc_raise_interrupt() < 0 ? -1 : result;                                             \
    }
/* Functions, by calling convention (the 3.9 Limited API has no METH_FASTCALL);
 * OC_METHOD is a PyMethodDef: a method table's entry, or a callback's. */
#define OC_EDGE_NOARGS(fn)                                                                         \
    enum { edge_flags_##fn = METH_NOARGS };                                                        \
    OC_EDGE_OBJECT(fn, (PyObject *self, PyObject *unused), (self, unused))
#define OC_EDGE_O(fn)                                                                              \
    enum { edge_flags_##fn = METH_O };                                                             \
    OC_EDGE_OBJECT(fn, (PyObject *self, PyObject *arg), (self, arg))
#define OC_EDGE_VARARGS(fn)                                                                        \
    enum { edge_flags_##fn = METH_VARARGS };                                                       \
    OC_EDGE_OBJECT(fn, (PyObject *self, PyObject *args), (self, args))
#define OC_EDGE_KEYWORDS(fn)                                                                       \
    enum { edge_flags_##fn = METH_VARARGS | METH_KEYWORDS };                                       \
    OC_EDGE_OBJECT(fn, (PyObject *self, PyObject *args, PyObject *kw), (self, args, kw))
#define OC_METHOD(name, fn, doc)                                                                   \
    {name, (PyCFunction)(void (*)(void))edge_##fn, edge_flags_##fn, doc}
/* Slots of a type or a module, by slot; OC_SLOT is the slot's entry. */
#define OC_EDGE_GETATTRO(fn)                                                                       \
    enum { edge_slot_##fn = Py_tp_getattro };                                                      \
    OC_EDGE_OBJECT(fn, (PyObject *self, PyObject *name), (self, name))
#define OC_EDGE_SETATTRO(fn)                                                                       \
    enum { edge_slot_##fn = Py_tp_setattro };                                                      \
    OC_EDGE_NUMBER(int, fn, (PyObject *self, PyObject *name, PyObject *value), (self, name, value))
#define OC_EDGE_RICHCOMPARE(fn)                                                                    \
    enum { edge_slot_##fn = Py_tp_richcompare };                                                   \
    OC_EDGE_OBJECT(fn, (PyObject *self, PyObject *other, int op), (self, other, op))
#define OC_EDGE_HASH(fn)                                                                           \
    enum { edge_slot_##fn = Py_tp_hash };                                                          \
    OC_EDGE_NUMBER(Py_hash_t, fn, (PyObject *self), (self))
#define OC_EDGE_REPR(fn)                                                                           \
    enum { edge_slot_##fn = Py_tp_repr };                                                          \
    OC_EDGE_OBJECT(fn, (PyObject *self), (self))
#define OC_EDGE_MODULE_EXEC(fn)                                                                    \
    enum { edge_slot_##fn = Py_mod_exec };                                                         \
    OC_EDGE_NUMBER(int, fn, (PyObject *module), (module))
#define OC_SLOT(fn) {edge_slot_##fn, (void *)edge_##fn}
/* A PyGetSetDef's getter; OC_GETTER is its entry (no setter). */
#define OC_EDGE_GETTER(fn) OC_EDGE_OBJECT(fn, (PyObject *self, void *closure), (self, closure))
#define OC_GETTER(name, fn, doc) {name, edge_##fn, NULL, doc, NULL}
/* A pending call: Py_AddPendingCall(edge_<fn>, arg). */
#define OC_EDGE_PENDING_CALL(fn) OC_EDGE_NUMBER(int, fn, (void *arg), (arg))
/* clang-format on */

/* atexit.register() of def's function, once per process for each
 * *registered flag (a forked child inherits both). Returns 0, or -1 with an
 * exception. */
int oc_register_at_exit(PyMethodDef *def, int *registered);
int oc_disabled_by_env(void);
/* What every row says under OUTOFCUDA_DISABLE (the boot says it too). */
#define OC_DISABLED_TEXT "off by OUTOFCUDA_DISABLE: torch imports as without outofcuda"

/* watcher.c */
int oc_watcher_init(PyObject *module); /* from module_exec */
int oc_watcher_install(void);          /* 0 ok, -1 with exception */
int oc_watcher_fire_if_imported(void);
extern PyMethodDef oc_watcher_methods[];

/* bridge.c: called with torch imported. Never raises. */
void oc_bridge_before_torch(PyObject *spec);
void oc_bridge_after_torch(PyObject *torch);
/* An `import torch` failed: restores the user's allocator variable and lets
 * the next attempt prepare afresh (it may load another copy of torch). */
void oc_bridge_import_failed(void);
/* 1 when oc_bridge_before_torch ran for this import attempt. */
int oc_bridge_prepared(void);

/* frameworks.c: packages that size GPU memory and choose code paths from
 * the allocator variable themselves; outofcuda leaves both to them. */
typedef struct {
    const char *package; /* its top-level module */
    const char *name;    /* as people write it */
    const char *owns;    /* what it manages itself */
    const char *evidence;
} oc_framework;
/* The name of the framework this process runs under, or NULL: one whose package is in
 * sys.modules (also while its own import is in progress, as when it imports
 * torch), or torch_memory_saver's library preloaded through LD_PRELOAD
 * (matched by its file name). A package
 * merely installed is not in use. Fills why with what was seen and why
 * outofcuda steps back. Never raises. */
const char *oc_framework_in_use(char *why, size_t whysz);
/* What outofcuda decided about frameworks at torch's import (at[0]) and
 * when CUDA started (at[1]): OC_FW_UNSET until then (status()'s words in
 * report.c). */
typedef enum { OC_FW_UNSET, OC_FW_NONE, OC_FW_LEFT_TO, OC_FW_OVERRIDE, OC_FW_GONE } oc_fw_code;
typedef struct {
    char left_to[32]; /* the one outofcuda left GPU memory to, "" none */
    char why[600];    /* why it owns GPU memory */
    oc_fw_code at[2];
} oc_framework_choice;
const oc_framework_choice *oc_framework_choice_get(void);
/* GPU memory left to the framework name (why: why it owns it), or to none
 * (NULL: the one it was left to is gone; why is kept). */
void oc_framework_leave_to(const char *name, const char *why);
/* What was decided at torch's import (when 0) or when CUDA started (1). */
void oc_framework_decided(int when, oc_fw_code code);

/* platform.c: where one of outofcuda's defaults cannot work. The allocator
 * defaults for this machine: `defaults` itself, or (when they are
 * outofcuda's own, are_outofcudas, and expandable segments cannot work here)
 * a copy in out without expandable_segments. */
const char *oc_platform_alloc_defaults(const char *defaults, int are_outofcudas, char *out,
                                       size_t outsz);
/* Appends to reason why the last oc_platform_alloc_defaults changed them
 * (value: the allocator string that resulted, the user's keys in it). */
void oc_platform_note(char *reason, size_t reasonsz, const char *value);
/* 1 where expandable segments cannot work (WSL), so no advice names them. */
int oc_platform_no_expandable(void);
extern PyMethodDef oc_platform_methods[];
/* Behind the test door, _outofcuda._testing (module.c). */
extern PyMethodDef oc_platform_testing_methods[];

/* report.c */
void oc_report_verbose(void);
/* What status() shows of the hook, told by the files that decide it: the
 * finder is on sys.meta_path; the torch callback ran; torch's __version__
 * as str (the report keeps its own reference; NULL: unknown). */
void oc_report_hook_installed(void);
int oc_report_hook_fired(void);     /* returns 1 when it had fired already */
int oc_report_hook_has_fired(void); /* the torch callback ran */
void oc_report_torch_version(PyObject *version);
/* 1 when cuBLAS may use TF32 for float32 matmuls now (torch's new precision
 * API where it has one, else the legacy flag), 0 when not, -1 unreadable. */
int oc_matmul_tf32(PyObject *c_mod);
extern PyMethodDef oc_report_methods[];

/* nvml.c */
typedef struct {
    char name[96];
    int cc_major, cc_minor;
    unsigned long long total, free, used;
    char uuid[96];
} oc_gpu_info;
int oc_nvml_available(char *why, size_t whysz);       /* 1 yes, 0 no (why filled) */
int oc_nvml_device_count(void);                       /* -1 when unavailable */
int oc_nvml_device_info(int index, oc_gpu_info *out); /* 0 ok, -1 */
typedef struct {
    unsigned int pid;
    unsigned long long used;
} oc_gpu_proc;
/* Every process NVML lists on GPU `index`, in *out (malloc'd, free() it);
 * count or -1. used is OC_NVML_NOT_AVAILABLE where the driver cannot tell. */
int oc_nvml_process_list(int index, oc_gpu_proc **out);
/* Sorts such a list most memory first, unknown sizes last, ties by pid. */
void oc_nvml_sort_procs(oc_gpu_proc *procs, int n);
#define OC_NVML_NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFull
int oc_proc_name(unsigned int pid, char *buf, size_t sz); /* /proc name: 0, or -1 */
#define OC_NVML_MAX_DEVICES 64
/* NVML indices of the devices CUDA shows this process, in torch's order
 * (CUDA_VISIBLE_DEVICES as indices, GPU-UUID prefixes or MIG instances,
 * which map to their GPU). Count or -1. */
int oc_nvml_visible_map(int *map, int max);
int oc_nvml_index(int torch_index); /* NVML index of torch's cuda:N, or -1 */
int oc_nvml_min_visible_cc(void);   /* lowest major*10+minor of those, or -1 */
extern PyMethodDef oc_nvml_methods[];
/* Percent of the last sample period the GPU (gpu) and its memory bus (mem)
 * were busy, all processes together. 0 ok, -1 (no NVML or no such figure). */
int oc_nvml_utilization(int index, unsigned *gpu, unsigned *mem);

/* oom.c */
/* With torch imported: prepares the observer and hooks. no_queue is NULL when
 * bridge.c's CUDA-init callback is queued, else why not (a reason). Arms
 * oc_oom_at_cuda_init when it has work. Never raises. */
void oc_oom_install(PyObject *torch, const char *no_queue);
void oc_oom_at_cuda_init(PyObject *torch); /* a step of the CUDA-init callback */
/* What counts as a CUDA OOM: torch's type (torch.cuda.OutOfMemoryError or
 * torch.OutOfMemoryError, from the torch in sys.modules), or a plain
 * RuntimeError whose text older paths raise instead (cuBLAS workspace,
 * torch before 1.13; exc needed for the text). Never raises. */
typedef enum { OC_OOM_NONE, OC_OOM_TYPE, OC_OOM_TEXT } oc_oom_kind;
oc_oom_kind oc_oom_kind_of(PyObject *type, PyObject *exc);
const char *oc_oom_ipython(void); /* status()'s "ipython", read from the shell */
extern PyMethodDef oc_oom_methods[];
extern PyMethodDef oc_oom_testing_methods[]; /* the test door's (module.c) */

/* api.c */
extern PyMethodDef oc_api_methods[];
typedef struct {
    long long allocated, reserved, peak_allocated;
} oc_torch_mem;
/* 1 filled, 0 when torch has not initialised CUDA (nothing is asked then). */
int oc_api_torch_stats(int torch_index, oc_torch_mem *out);
/* gc.collect (if configured) + empty_cache; 0 ok, -1 with an exception set. */
int oc_api_clear_cache(long long *released);
/* The CUDA autocast dtype ("bfloat16" or "float16"): OUTOFCUDA_AMP_DTYPE's,
 * or under auto the compute capability's (8.0 and up: bfloat16; the lowest
 * visible GPU's, from NVML); NULL when auto cannot know it. reason: why, in
 * words. */
const char *oc_amp_cuda_dtype(const oc_config *cfg, char *reason, size_t sz);
/* The num_workers smart_dataloader picks (OUTOFCUDA_NUM_WORKERS capped at the
 * usable cores); *cpus: those cores (affinity mask, cgroup quota). */
long oc_loader_suggestion(long *cpus);
/* The splits auto_microbatch made in this process. */
long long oc_api_microbatch_splits(void);

/* facts.c */
extern PyMethodDef oc_facts_methods[];

/* monitor.c */
extern PyMethodDef oc_monitor_methods[];
/* Behind the test door, _outofcuda._testing (module.c). */
extern PyMethodDef oc_monitor_testing_methods[];

/* small helpers (common.c) */
PyObject *oc_getattr_chain(PyObject *obj, const char *dotted);
/* The texts of n advice items as a new list of str, or NULL. */
PyObject *oc_advice_texts(const oc_advice_item *items, int n);
/* sys.modules[name] (new ref), or NULL with no exception: never imports. */
PyObject *oc_sys_module(const char *name);                      /* new ref or NULL, no exception */
int oc_call_bool(PyObject *owner, const char *name, int value); /* 1 called, 0 missing, -1 error */
/* owner.name() or, with a, owner.name(a, b): the result (new ref), or NULL
 * with the error swallowed (a missing attribute included), traced under
 * OUTOFCUDA_DEBUG at the caller's line. */
PyObject *oc_call_quiet_at(PyObject *owner, const char *name, const char *a, const char *b,
                           const char *file, int line, const char *func);
#define oc_call_quiet(owner, name, a, b)                                                           \
    oc_call_quiet_at(owner, name, a, b, __FILE__, __LINE__, __func__)
/* A copy of str into buf, cut where it does not fit between two characters. */
const char *oc_utf8(PyObject *str, char *buf, size_t sz);
/* Text appended to a buffer of cap bytes (buf NULL: none); what does not fit is cut. */
typedef struct {
    char *buf;
    size_t len, cap;
} oc_text;
void oc_appendf(oc_text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* How many of the len bytes of UTF-8 at s fit in max bytes without cutting
 * a character in two. */
size_t oc_utf8_fit(const char *s, size_t len, size_t max);
/* An API argument that must be a str, as bytes (new ref) with surrogates
 * kept (surrogateescape: a path or a value from the environment), or NULL
 * with TypeError(message) when it is not a str. */
PyObject *oc_arg_bytes(PyObject *arg, const char *message);
/* The imported torch's release (oc_torch_version_number of its __version__);
 * 0 when it has none to read (errors swallowed). */
long oc_torch_version(PyObject *torch);
/* A file to write later (OUTOFCUDA_OOM_SNAPSHOT, OUTOFCUDA_SUMMARY's .json):
 * its directory, as given, into dir (for messages), resolved now (the working
 * directory may change before the file is written), and the file's absolute
 * path into out. Returns 0; -1 when the directory does not exist; -2 when the
 * path does not fit out (out is "" on failure). */
int oc_resolve_file_path(const char *path, char *dir, size_t dirsz, char *out, size_t outsz);

/* knownbugs.c: decides what it can with torch imported (never reads the
 * cuDNN version: that loads cuDNN), and the rest from the CUDA-init callback,
 * where it also acts. Neither raises nor queues anything. at_import arms
 * the callback's step when it has work (no_queue: why there is no queue, or
 * NULL). */
void oc_known_bugs_at_import(PyObject *torch, const char *no_queue);
void oc_known_bugs_at_cuda_init(PyObject *torch);
PyObject *oc_known_bugs_status(void); /* new list, or NULL with an exception */
/* 1 when OUTOFCUDA_KNOWN_BUGS leaves row `id` on (the steer may act). */
int oc_known_bug_on(const char *id);
/* The exit summary's lines naming the rows that apply and that outofcuda
 * does not avoid, each line starting with prefix; returns the length. */
size_t oc_known_bugs_summary(char *buf, size_t sz, const char *prefix);
extern PyMethodDef oc_known_bugs_methods[];

/* thread.c: one native thread, its lock and its condition variable, owned
 * by the process that made them (pid). */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake; /* on CLOCK_MONOTONIC */
    pthread_t thread;
    pid_t pid;
} oc_thread;
/* Fresh lock and condition variable, owned by this process (also what a
 * copy inherited through fork() gets, never the parent's). */
void oc_thread_init(oc_thread *t);
void oc_thread_destroy(oc_thread *t);
int oc_thread_inherited(const oc_thread *t); /* 1: made by another process */
/* Starts fn(arg) with every signal blocked, named `name` where the system
 * allows (NULL: unnamed). Returns 0 or an errno. */
int oc_thread_start(oc_thread *t, void *(*fn)(void *), void *arg, const char *name);
/* Sets *stop_requested under t's lock and wakes the thread. */
void oc_thread_request_stop(oc_thread *t, int *stop_requested);
/* Now plus seconds and nanoseconds (clamped to 0..999999999) on
 * CLOCK_MONOTONIC, with no double round trip. */
struct timespec oc_thread_deadline(long long seconds, long nanoseconds);
/* With t's lock held: sleeps until *stop_requested is set or the deadline
 * passes (or the wait fails); returns with the lock held. */
void oc_thread_wait(oc_thread *t, const int *stop_requested, const struct timespec *deadline);
/* Joins thread, waiting at most limit_ms milliseconds where glibc can bound
 * the wait (0: no bound). Returns 1 when joined. Call without the GIL. */
int oc_thread_join(pthread_t thread, long limit_ms);
double oc_thread_now(void); /* CLOCK_MONOTONIC, in seconds */

/* summary.c: OUTOFCUDA_SUMMARY, what the GPU did, printed at exit */
/* What the summary says of torch and its allocator, as bridge.c read them. */
typedef struct {
    int cuda_build, hip_build; /* torch's build: why no GPU was sampled */
    int expandable;            /* the allocator string turns expandable segments on */
} oc_summary_torch;
/* With torch imported: starts the stack sampler when the summary is on, and
 * arms its CUDA-init step where cuda_queue says CUDA's start can be queued;
 * keeps *torch for the block at exit. */
void oc_summary_prepare(int cuda_queue, const oc_summary_torch *torch);
/* One more CUDA OOM torch's observer reported (oom.c), for the summary. */
void oc_summary_note_oom(void);
void oc_summary_at_cuda_init(void); /* a step of the CUDA-init callback */
extern PyMethodDef oc_summary_methods[];

/* 1 when the ELF file at path holds every byte its headers promise: each
 * segment the loader maps, and the section headers, which the linker writes
 * last. A partly written extension (an interrupted install, a full disk) fails
 * this: dlopen would map it past the end of the file, and the first touch of
 * a missing page kills the process with SIGBUS. */
#define OC_INCOMPLETE_FMT "%U is incomplete (a partly written file): reinstall outofcuda"
static inline int oc_elf_complete(const char *path)
{
    Elf64_Ehdr eh;
    Elf64_Phdr ph;
    struct stat st;
    int ok = 0, fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    if (fstat(fd, &st) == 0 && pread(fd, &eh, sizeof eh, 0) == (ssize_t)sizeof eh &&
        memcmp(eh.e_ident, ELFMAG, SELFMAG) == 0 && eh.e_ident[EI_CLASS] == ELFCLASS64 &&
        eh.e_phentsize == sizeof ph) {
        uint64_t size = (uint64_t)st.st_size;
        ok = eh.e_shoff + (uint64_t)eh.e_shnum * eh.e_shentsize <= size;
        for (unsigned i = 0; ok && i < eh.e_phnum; i++) {
            off_t at = (off_t)(eh.e_phoff + (uint64_t)i * sizeof ph);
            ok = pread(fd, &ph, sizeof ph, at) == (ssize_t)sizeof ph &&
                 (ph.p_type != PT_LOAD || ph.p_offset + ph.p_filesz <= size);
        }
    }
    close(fd);
    return ok;
}

/* Both extensions: the sibling extension `to`, loaded by path from the
 * directory of `self` (the module of the extension named `from`): never by
 * name, as the working directory may be on sys.path. `dir/from<suffix>` ->
 * `dir/to<suffix>`; not put in sys.modules. New reference, or NULL with an
 * exception. Here, inline, because the boot links nothing of the engine. */
static inline PyObject *oc_load_sibling(PyObject *self, const char *from, const char *to)
{
    PyObject *file = PyModule_GetFilenameObject(self), *name, *parts, *path = NULL;
    PyObject *util, *spec = NULL, *loader = NULL, *mod = NULL, *res = NULL;
    name = file != NULL ? PyUnicode_FromString(from) : NULL;
    parts = name != NULL ? PyUnicode_RSplit(file, name, 1) : NULL; /* at the last `from` */
    if (parts != NULL && PyList_Size(parts) == 2)
        path =
            PyUnicode_FromFormat("%U%s%U", PyList_GetItem(parts, 0), to, PyList_GetItem(parts, 1));
    else if (parts != NULL)
        PyErr_Format(PyExc_ImportError, "%U is not named %s*", file, from);
    Py_XDECREF(parts);
    Py_XDECREF(name);
    Py_XDECREF(file);
    if (path == NULL)
        return NULL;
    res = PyUnicode_EncodeFSDefault(path);
    if (res == NULL || !oc_elf_complete(PyBytes_AsString(res))) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ImportError, OC_INCOMPLETE_FMT, path);
        Py_XDECREF(res);
        Py_DECREF(path);
        return NULL;
    }
    Py_CLEAR(res);
    util = PyImport_ImportModule("importlib.util");
    if (util != NULL)
        spec = PyObject_CallMethod(util, "spec_from_file_location", "sO", to, path);
    if (spec == Py_None)
        PyErr_Format(PyExc_ImportError, "%U is not a loadable extension", path);
    else if (spec != NULL)
        mod = PyObject_CallMethod(util, "module_from_spec", "O", spec);
    loader = mod ? PyObject_GetAttrString(spec, "loader") : NULL;
    res = loader ? PyObject_CallMethod(loader, "exec_module", "O", mod) : NULL;
    if (res == NULL)
        Py_CLEAR(mod);
    Py_XDECREF(res);
    Py_XDECREF(loader);
    Py_XDECREF(spec);
    Py_XDECREF(util);
    Py_DECREF(path);
    return mod;
}

/* Behind the test door, _outofcuda._testing (module.c). */
extern PyMethodDef oc_summary_testing_methods[];
#endif /* OC_PURE_C */
#endif /* OC_H */
