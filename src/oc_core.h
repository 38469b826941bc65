/* oc_core.h - oc.h's pure C part: safe to include without Python (fuzzers, unit tests) */
#ifndef OC_CORE_H
#define OC_CORE_H

#include <stddef.h>

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
    OC_KB_IPC_NO_EXPANDABLE, /* expandable segments off in a DataLoader worker when CUDA starts */
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

/* Notes on a decision, as stable codes (status()'s "notes"), each with the
 * words it adds to the sentence (NULL: the writer's sentence says it). */
#define OC_REC_NOTES(X)                                                                            \
    X(USER_KEYS_KEPT, "user_keys_kept", "the user's keys kept")                                    \
    X(UNKNOWN_KEYS_LEFT_OUT, "unknown_keys_left_out", "left out (unknown to this torch): ")        \
    X(NATIVE_KEYS_LEFT_OUT, "native_keys_left_out",                                                \
      "left out (the cudaMallocAsync backend ignores them): ")                                     \
    X(EXPANDABLE_HELD_BACK, "expandable_held_back",                                                \
      "expandable_segments left off beside the user's max_split_size_mb (together they let "       \
      "reserved memory grow, pytorch issue 123548)")                                               \
    X(RESTORED, "restored_for_children",                                                           \
      "the variable was restored for child processes (it was written while torch imported: "       \
      "this release reads `backend` only then)")                                                   \
    X(CUDNN_ATTENTION_OFF, "cudnn_attention_off", "cuDNN attention turned off when CUDA started")  \
    /* The writer's sentence says these: */                                                        \
    X(PLATFORM_NO_EXPANDABLE, "platform_no_expandable", NULL) /* on this platform (WSL) */         \
    X(USER_EXPANDABLE_KEPT, "user_expandable_kept", NULL)     /* though not on this platform */    \
    X(FRAMEWORK_OVERRIDE, "framework_override", NULL)         /* OUTOFCUDA_FRAMEWORK_OVERRIDE=1 */ \
    X(GC_THRESHOLD_IDLE, "gc_threshold_idle", NULL) /* no fraction below 1 to act under */         \
    X(LOCAL_RANK, "local_rank", NULL)               /* the device is LOCAL_RANK's */               \
    X(CAPABILITY_FROM_NVML, "capability_from_nvml", NULL)                                          \
    X(GENERIC_VARIABLE, "generic_variable", NULL) /* PYTORCH_ALLOC_CONF reached 2.9 or 2.10 */
#define OC_NOTE_ENUM(id, name, words) OC_NOTE_##id,
typedef enum { OC_REC_NOTES(OC_NOTE_ENUM) OC_REC_NOTE_COUNT } oc_rec_note;
#undef OC_NOTE_ENUM

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
    const char *off_by;    /* the OUTOFCUDA_* variable of OC_CODE_OFF (static), else NULL */
    const char *known_bug; /* the known bug a note acts on (static), or NULL */
    const char *variable;  /* the allocator variable read (static), or NULL */
    unsigned notes;        /* 1 << oc_rec_note */
    int cc;                /* the compute capability decided from (major*10+minor), 0 none */
    double fraction;
    long device;
    oc_rec_state state;
    oc_rec_code code;
    oc_rec_value kind;
    int flag;
    oc_cost_id cost; /* a known cost of the choice (oc_record_cost) */
    int sdpa[3];
    struct {
        const char *hooks; /* static text */
        char observer[400];
        char snapshot[4096]; /* "" none */
    } oom;
    char reason[OC_REASON_LEN];
    char text[OC_ALLOC_CONF_MAX];
    char left_out[200]; /* the defaults' keys the allocator's merge left out, comma-separated */
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
const char *oc_rec_note_name(oc_rec_note note);
/* The record of opt (read-only: every write goes through the functions
 * below); NULL for an opt out of range. */
const oc_record *oc_record_get(oc_opt opt);
/* Writes opt's state, code and sentence (printf format); the value becomes
 * None, off_by NULL. The typed fields the setters below fill stay. */
void oc_record_set(oc_opt opt, oc_rec_state state, oc_rec_code code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* opt is off by the user's variable var (static): skipped, OC_CODE_OFF. */
void oc_record_off(oc_opt opt, const char *var);
/* Every record: state, code and reason. */
void oc_record_set_all(oc_rec_state state, oc_rec_code code, const char *reason);
void oc_record_bool(oc_opt opt, int value); /* TF32's: {"matmul": value} */
void oc_record_sdpa(int flash, int mem_efficient, int math);
void oc_record_text(oc_opt opt, const char *text);
void oc_record_fraction(double fraction, long device);
/* Adds notes (1 << oc_rec_note), the variable read (static) and the keys
 * left out (NULL: kept) to opt's record. */
void oc_record_notes(oc_opt opt, unsigned notes, const char *variable, const char *left_out);
/* The program's own memory fraction (status()'s "chosen" with program_chose)
 * and the variable that holds it, or NULL. */
void oc_record_chosen(double fraction, const char *variable);
/* The autocast dtype's compute capability (major*10+minor), from NVML. */
void oc_record_capability(int cc);
/* The OOM handler's value; NULL leaves a field as it was. */
void oc_record_oom(const char *hooks, const char *observer, const char *snapshot);
/* Adds a note (and the known bug it acts on, or NULL) to opt's record. */
void oc_record_note(oc_opt opt, oc_rec_note note, const char *known_bug);
void oc_record_cost(oc_opt opt, oc_cost_id cost);
const oc_cost *oc_cost_get(oc_cost_id cost); /* NULL for OC_COST_NONE */
/* The sentence status() shows: the writer's, with its notes' words. */
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

#endif /* OC_CORE_H */
