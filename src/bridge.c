/* bridge.c - what happens around `import torch`: the allocator variable before
 * torch's libraries load, then TF32, cuDNN, SDPA, the memory fraction, the
 * autocast dtype and the OOM handler through torch._C once it has executed.
 * Every step is gated on what the running torch has, never initialises CUDA,
 * and records why it was applied or skipped. */
#include "oc.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- reading torch/version.py without importing torch ---- */

/* torch about to load, from its version.py, then from the module that
 * executed (bridge.c's own; process-wide, under the GIL: see oc.h). */
static struct {
    long ver;       /* oc_torch_version_number; 0 unknown */
    int cuda_build; /* torch.version.cuda is not None */
    int hip_build;
    int known;
} build;

/* Finds `name` at the start of a line followed by '=' (an annotation may sit
 * between) and copies the quoted value, or "None". */
static void version_field(const char *text, const char *name, char *out, size_t sz)
{
    size_t n = strlen(name);
    out[0] = '\0';
    for (const char *line = text; line && *line;
         line = strchr(line, '\n'), line = line ? line + 1 : NULL) {
        const char *p = line, *eq, *q;
        if (strncmp(p, name, n) != 0 || !(p[n] == ' ' || p[n] == ':' || p[n] == '='))
            continue;
        eq = strchr(p, '=');
        if (eq == NULL)
            continue;
        q = eq + 1;
        while (*q == ' ')
            q++;
        if (*q == '\'' || *q == '"') {
            char quote = *q++;
            size_t i = 0;
            while (q[i] && q[i] != quote && q[i] != '\n' && i + 1 < sz) {
                out[i] = q[i];
                i++;
            }
            out[i] = '\0';
        } else if (strncmp(q, "None", 4) == 0) {
            snprintf(out, sz, "None");
        }
        return;
    }
}

static void read_version_file(PyObject *spec)
{
    char origin[4096], path[4200], text[8192], v[64], cuda[64], hip[64];
    PyObject *o;
    FILE *f;
    size_t n;
    char *slash;
    /* Facts of an earlier, failed attempt (another copy of torch) never
     * carry over to this one. */
    memset(&build, 0, sizeof build);
    o = spec ? PyObject_GetAttrString(spec, "origin") : NULL;
    if (o == NULL || !PyUnicode_Check(o)) {
        OC_CLEAR();
        Py_XDECREF(o);
        return;
    }
    oc_utf8(o, origin, sizeof origin);
    Py_DECREF(o);
    slash = strrchr(origin, '/');
    if (slash == NULL)
        return;
    *slash = '\0';
    snprintf(path, sizeof path, "%s/version.py", origin);
    f = fopen(path, "r");
    if (f == NULL)
        return;
    n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    version_field(text, "__version__", v, sizeof v);
    version_field(text, "cuda", cuda, sizeof cuda);
    version_field(text, "hip", hip, sizeof hip);
    build.ver = oc_torch_version_number(v);
    build.cuda_build = cuda[0] != '\0' && strcmp(cuda, "None") != 0;
    build.hip_build = hip[0] != '\0' && strcmp(hip, "None") != 0;
    build.known = build.ver != 0;
}

/* Reads the same facts from the torch that executed: the one that counts,
 * whatever version.py said before it ran. Keeps the earlier facts when the
 * module has no version to read. */
static void read_version_module(PyObject *torch)
{
    PyObject *cuda, *hip;
    long ver = oc_torch_version(torch);
    if (ver == 0)
        return;
    cuda = oc_getattr_chain(torch, "version.cuda");
    hip = oc_getattr_chain(torch, "version.hip");
    build.ver = ver;
    build.cuda_build = cuda != NULL && cuda != Py_None;
    build.hip_build = hip != NULL && hip != Py_None;
    build.known = 1;
    Py_XDECREF(cuda);
    Py_XDECREF(hip);
}

/* ---- allocator (before torch loads) ---- */

/* The merge outofcuda works out for the allocator variable, and the
 * sentence that says what became of it. */
static char alloc_value[OC_ALLOC_CONF_MAX];
static char alloc_reason[1000];
static int alloc_applied;
/* The framework GPU memory was left to at torch's import ("" none). */
static char left_at_import[32];
static int alloc_by_setter; /* the merge went to torch's runtime setter alone */
/* The user's PYTORCH_ALLOC_CONF, which 2.9 and 2.10 ignore, went to torch. */
static int alloc_generic;
/* The record's notes (1 << oc_rec_note), the variable read, the keys left out. */
static unsigned alloc_notes;
static const char *alloc_variable;
static char alloc_left_out[200];
/* The variable as the user left it, given back once torch has read
 * outofcuda's value: children inherit the user's environment. */
static struct {
    int written; /* outofcuda changed the variable and has not restored it */
    int had;     /* the user had set it (possibly empty) */
    char name[32];
    char value[OC_ALLOC_CONF_MAX];
} alloc_saved;

/* ctx: int, non-zero when cudaMallocAsync is the backend. That backend
 * ignores every native-allocator key and torch warns about each, so only
 * `backend` itself may be added then. */
static int key_allowed(const char *key, void *ctx)
{
    if (*(const int *)ctx && strcmp(key, "backend") != 0)
        return 0;
    return oc_alloc_key_known(key, build.ver);
}

/* Returns 1 when the allocator string chooses backend:cudaMallocAsync. */
static int async_backend(const char *conf)
{
    return oc_alloc_has(conf, "backend", "cudaMallocAsync");
}

/* The allocator variable the user set, as this release reads it
 * (oc_alloc_user_var); its value through *value ("" when unset). */
static const char *user_alloc_var(const char **value)
{
    const char *name = oc_alloc_user_var(build.ver, value);
    /* Known bug alloc-conf-generic-ignored: the user's keys are read where
     * the user put them, and reach torch in outofcuda's string. */
    if (*value == NULL && oc_known_bug_on("alloc-conf-generic-ignored") &&
        oc_alloc_generic_ignored(build.ver, value))
        name = OC_VAR("PYTORCH_ALLOC_CONF");
    if (*value == NULL)
        *value = "";
    return name;
}

/* Sets (value) or deletes (NULL) os.environ[name]: os.environ keeps
 * Python's view and the C environment (what torch's getenv reads) in step;
 * sys.modules has os since start-up. Returns 0, or -1 with an exception. */
static int set_environ(const char *name, const char *value)
{
    PyObject *os = PyImport_ImportModule("os");
    PyObject *environ = os ? PyObject_GetAttrString(os, "environ") : NULL;
    PyObject *v = value ? PyUnicode_FromString(value) : NULL;
    int rc = -1;
    if (environ != NULL && value == NULL) {
        rc = PyMapping_DelItemString(environ, name);
        if (rc < 0 && PyErr_ExceptionMatches(PyExc_KeyError)) {
            OC_CLEAR_ABSENT(); /* already gone (deleted meanwhile) is what was asked */
            rc = 0;
        }
    } else if (environ != NULL && v != NULL)
        rc = PyMapping_SetItemString(environ, name, v);
    Py_XDECREF(v);
    Py_XDECREF(environ);
    Py_XDECREF(os);
    return rc;
}

/* Gives the allocator variable back as the user had it (value or absence);
 * os.environ's refusal is recorded as outofcuda's error. */
static void restore_allocator_env(void)
{
    if (!alloc_saved.written)
        return;
    alloc_saved.written = 0;
    if (set_environ(alloc_saved.name, alloc_saved.had ? alloc_saved.value : NULL) < 0)
        oc_set_error("restoring the allocator variable failed");
}

/* Returns 1 when a framework owns GPU memory in this process and outofcuda
 * steps back (remembered by oc_framework_leave_to); 0 otherwise, with a note in
 * override_note when OUTOFCUDA_FRAMEWORK_OVERRIDE=1 kept outofcuda's
 * settings beside one. */
static int framework_owns_memory(const oc_config *cfg, char *override_note, size_t notesz)
{
    const oc_framework_choice *fw = oc_framework_choice_get();
    char why[sizeof fw->why];
    const char *name;
    if (override_note != NULL && notesz > 0)
        override_note[0] = '\0';
    if (fw->left_to[0])
        return 1;
    name = oc_framework_in_use(why, sizeof why);
    if (name == NULL)
        return 0;
    if (cfg->framework_override) {
        if (override_note != NULL)
            snprintf(override_note, notesz,
                     "; %s is in use: OUTOFCUDA_FRAMEWORK_OVERRIDE=1 keeps outofcuda's settings",
                     name);
        return 0;
    }
    oc_framework_leave_to(name, why);
    return 1;
}

/* Returns 1 when torch's allocator can take outofcuda's merge through the
 * runtime setter after `import torch`, before CUDA starts, so the variable
 * need not be written at all: a child spawned while torch imports (a
 * thread's subprocess.run) then inherits the user's environment, never
 * outofcuda's string. From 2.9 on (oc_alloc_call_setter) every key but `backend` is
 * parsed on the allocator's first use or at the setter's call, and the setter parses
 * the whole string. `backend` alone is read while torch's libraries load:
 * where outofcuda's string adds one the user's does not hold, the variable
 * is still written, for the import alone (restored by settle_allocator).
 * Before 2.9 it is written the same way. */
static int setter_configures(const char *user)
{
    return build.ver >= 20900 && (oc_alloc_value(alloc_value, "backend", NULL, 0) != 1 ||
                                  oc_alloc_value(user, "backend", NULL, 0) == 1);
}

/* Why the allocator record says what it says (beside alloc_reason):
 * written with the sentence, recorded by record_allocator. */
static oc_rec_code alloc_code;

/* The allocator's sentence, with its code. */
static void alloc_say(oc_rec_code code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void alloc_say(oc_rec_code code, const char *fmt, ...)
{
    va_list ap;
    alloc_code = code;
    va_start(ap, fmt);
    vsnprintf(alloc_reason, sizeof alloc_reason, fmt, ap);
    va_end(ap);
}

static void prepare_allocator(const oc_config *cfg)
{
    char err[160], fw_note[120], platform_defaults[OC_ALLOC_CONF_MAX];
    const oc_framework_choice *fw = oc_framework_choice_get();
    const char *name, *user, *defaults, *write_name, *had;
    int async, held_back, owned, generic;
    alloc_applied = alloc_generic = 0;
    alloc_notes = 0;
    alloc_variable = NULL;
    alloc_value[0] = alloc_left_out[0] = '\0';
    alloc_code = OC_CODE_NOT_IMPORTED;
    /* The framework's own import is in progress (vllm/__init__.py imports
     * torch through vllm.env_override): it reads the variable as the user
     * set it, so it stays unwritten. The merge is still worked out: an
     * import that fails after importing torch leaves no framework behind,
     * and the CUDA-init callback then gives it to torch's runtime setter. */
    owned = framework_owns_memory(cfg, fw_note, sizeof fw_note);
    snprintf(left_at_import, sizeof left_at_import, "%s", fw->left_to);
    if (owned)
        alloc_say(OC_CODE_FRAMEWORK,
                  "left to %s: the allocator variable stays as the user set it, and no memory "
                  "fraction is set (OUTOFCUDA_FRAMEWORK_OVERRIDE=1 applies outofcuda's anyway). "
                  "%s",
                  fw->left_to, fw->why);
    oc_framework_decided(0, owned ? OC_FW_LEFT_TO : fw_note[0] ? OC_FW_OVERRIDE : OC_FW_NONE);
    /* Off (OUTOFCUDA_ALLOC_CONF=off): nothing merged, nothing written; the
     * user's own allocator variable is torch's alone. */
    if (oc_config_off(cfg, "OUTOFCUDA_ALLOC_CONF"))
        return;
    if (!build.known) {
        if (!owned)
            alloc_say(OC_CODE_VERSION_UNKNOWN,
                      "torch's version could not be read before it loaded");
        return;
    }
    if (!build.cuda_build) {
        if (!owned)
            alloc_say(build.hip_build ? OC_CODE_ROCM : OC_CODE_NO_CUDA, "%s",
                      build.hip_build
                          ? "ROCm build of torch: outofcuda configures CUDA's allocator only"
                          : "this torch build has no CUDA");
        return;
    }
    alloc_variable = name = user_alloc_var(&user);
    generic = strcmp(name, OC_VAR("PYTORCH_ALLOC_CONF")) == 0 && build.ver < 21100;
    /* OUTOFCUDA_ALLOC_CONF unset (config.c keeps the conditional defaults
     * then): the defaults may lose a key this machine cannot use. */
    defaults = oc_platform_alloc_defaults(cfg->alloc_conf, cfg->alloc_conf_no_expandable[0] != '\0',
                                          platform_defaults, sizeof platform_defaults);
    async = async_backend(user) || (!user[0] && async_backend(defaults));
    if (oc_alloc_merge_defaults(defaults, cfg->alloc_conf_no_expandable, user, key_allowed, &async,
                                alloc_value, sizeof alloc_value, alloc_left_out,
                                sizeof alloc_left_out, err, sizeof err, &held_back) != 0) {
        /* A value outofcuda cannot parse is the user's business: leave it whole. */
        if (!owned)
            alloc_say(OC_CODE_NOT_UNDERSTOOD, "left alone: %s is not understood (%s)", name, err);
        alloc_value[0] = alloc_left_out[0] = '\0';
        return;
    }
    if (owned) {
        alloc_left_out[0] = '\0'; /* the sentence says the framework's, not the merge's */
        return;
    }
    alloc_notes = (alloc_left_out[0] ? 1u << (async ? OC_NOTE_NATIVE_KEYS_LEFT_OUT
                                                    : OC_NOTE_UNKNOWN_KEYS_LEFT_OUT)
                                     : 0) |
                  (held_back ? 1u << OC_NOTE_EXPANDABLE_HELD_BACK : 0) |
                  (defaults == cfg->alloc_conf        ? 0
                   : oc_alloc_expandable(alloc_value) ? 1u << OC_NOTE_USER_EXPANDABLE_KEPT
                                                      : 1u << OC_NOTE_PLATFORM_NO_EXPANDABLE) |
                  (fw_note[0] ? 1u << OC_NOTE_FRAMEWORK_OVERRIDE : 0);
    /* Where torch ignores the user's variable, the user's string still has
     * to reach it, even with nothing added. */
    if (strcmp(alloc_value, user) == 0 && !generic) {
        /* Nothing to add: the variable stays exactly as the user set it. */
        alloc_say(OC_CODE_NOTHING_TO_ADD, "nothing added to %s%s", name, fw_note);
        return;
    }
    alloc_generic = generic;
    alloc_notes |= user[0] ? 1u << OC_NOTE_USER_KEYS_KEPT : 0;
    if (setter_configures(user)) {
        alloc_by_setter = 1;
        alloc_applied = 1;
        alloc_say(OC_CODE_RUNTIME_SETTER,
                  "given to torch's runtime setter once torch loaded, the environment never "
                  "written (%s read as the user set it)%s",
                  name, fw_note);
        return;
    }
    /* The variable this release reads (not the ignored one the user set). */
    write_name = generic ? oc_alloc_env_name(build.ver) : name;
    had = oc_env(write_name);
    alloc_saved.had = had != NULL;
    snprintf(alloc_saved.value, sizeof alloc_saved.value, "%s", had ? had : "");
    snprintf(alloc_saved.name, sizeof alloc_saved.name, "%s", write_name);
    if (set_environ(write_name, alloc_value) < 0) {
        alloc_generic = 0;
        oc_set_error("setting the allocator variable failed");
        alloc_say(OC_CODE_ERROR, "setting %s failed", write_name);
        return;
    }
    alloc_saved.written = 1;
    alloc_applied = 1;
    alloc_say(OC_CODE_ENV_WRITTEN, "%s set while torch loaded%s", write_name, fw_note);
}

/* The work before torch's code runs is done for this import attempt (the
 * watcher asks; an attempt that fails lets the next prepare afresh). */
static int prepared;

int oc_bridge_prepared(void)
{
    return prepared;
}

void oc_bridge_before_torch(PyObject *spec)
{
    const oc_config *cfg = oc_config_get();
    prepared = 1;
    if (cfg->disable)
        return;
    read_version_file(spec);
    prepare_allocator(cfg);
    /* Said once, for the preparation that changed the defaults. */
    if (alloc_notes & (1u << OC_NOTE_PLATFORM_NO_EXPANDABLE | 1u << OC_NOTE_USER_EXPANDABLE_KEPT))
        snprintf(alloc_reason + strlen(alloc_reason), sizeof alloc_reason - strlen(alloc_reason),
                 "; %s on this platform: %s",
                 alloc_notes >> OC_NOTE_USER_EXPANDABLE_KEPT & 1u
                     ? "the user's expandable_segments:True kept, though"
                     : "expandable_segments left out of outofcuda's defaults",
                 oc_platform_no_expandable());
}

void oc_bridge_import_failed(void)
{
    /* The next attempt may load another copy of torch: it is prepared
     * afresh, from its own version file, with the user's environment. */
    restore_allocator_env();
    alloc_by_setter = 0;
    memset(&build, 0, sizeof build);
    prepared = 0;
}

/* ---- after torch executed ---- */

/* Calls torch._C.<fn>(value) when it exists; a failure is recorded as the
 * engine's error, naming the step. */
static int set_flag(PyObject *c_mod, const char *fn, int value, const char *step)
{
    int rc = oc_call_bool(c_mod, fn, value);
    if (rc < 0) {
        char msg[200];
        snprintf(msg, sizeof msg, "%s: torch._C.%s failed", step, fn);
        oc_set_error(msg);
    }
    return rc;
}

static int flags_frozen(PyObject *torch)
{
    PyObject *fn = oc_getattr_chain(torch, "backends.flags_frozen");
    PyObject *r = fn ? PyObject_CallObject(fn, NULL) : NULL;
    int frozen;
    OC_CLEAR();
    frozen = r != NULL && PyObject_IsTrue(r) == 1;
    Py_XDECREF(r);
    Py_XDECREF(fn);
    return frozen;
}

/* Skips opt, when torch.backends.disable_global_flags() froze the flags it
 * sets (cuDNN's among them), and returns 1. */
static int skip_frozen(PyObject *torch, oc_opt opt)
{
    if (!flags_frozen(torch))
        return 0;
    oc_record_set(opt, OC_REC_SKIPPED, OC_CODE_FLAGS_FROZEN,
                  "torch.backends.disable_global_flags() was called");
    return 1;
}

/* ---- TF32, decided when CUDA starts ----
 *
 * torch 2.9+ keeps two precision APIs (the legacy allow_tf32 /
 * set_float32_matmul_precision and the new fp32_precision attributes) and
 * remembers which one wrote a setting: a legacy write at `import torch`
 * makes a later `matmul.fp32_precision = "ieee"` leave the legacy getters
 * raising, and counts as a matmul-specific choice that beats the program's
 * global `torch.backends.fp32_precision = "ieee"` (measured on the CUDA
 * build of 2.14.1). A write the program makes before any write of
 * outofcuda always ends exactly as without outofcuda. So TF32 is written
 * from the CUDA-init callback, and only when the program chose nothing by
 * then; cuDNN TF32 is never written (it is torch's default). */

/* Returns 1 when the program already chose its float32 matmul precision
 * (why says how), 0 when it did not, -1 when that cannot be read (why says
 * so). On 2.9+ every choice, through either API, the global switch, cuDNN's
 * fp32_precision or set_float32_matmul_precision, leaves one of the three
 * new-API levels that decide matmuls off "none"; the legacy getters, which
 * raise after a mix and warn on 2.9.0, are not read there. Before 2.9 only a
 * value other than torch's default is visible: a program that re-sets the
 * default itself is told apart from one that chose nothing only on 2.9+. */
static int precision_chosen(PyObject *c_mod, char *why, size_t sz)
{
    static const char *const levels[][2] = {
        {"cuda", "matmul"}, {"cuda", "all"}, {"generic", "all"}};
    PyObject *getter = PyObject_GetAttrString(c_mod, "_get_fp32_precision_getter");
    if (getter != NULL) {
        Py_DECREF(getter);
        for (size_t i = 0; i < 3; i++) {
            PyObject *r =
                oc_call_quiet(c_mod, "_get_fp32_precision_getter", levels[i][0], levels[i][1]);
            char v[32];
            if (r == NULL || !PyUnicode_Check(r)) {
                Py_XDECREF(r);
                snprintf(why, sz, "torch's fp32_precision for %s/%s could not be read",
                         levels[i][0], levels[i][1]);
                return -1;
            }
            oc_utf8(r, v, sizeof v);
            Py_DECREF(r);
            if (strcmp(v, "none") != 0) {
                snprintf(why, sz,
                         "the program chose fp32_precision '%s' (%s/%s) before CUDA started", v,
                         levels[i][0], levels[i][1]);
                return 1;
            }
        }
        return 0;
    }
    OC_CLEAR();
    {
        PyObject *fmp = oc_call_quiet(c_mod, "_get_float32_matmul_precision", NULL, NULL);
        int tf32 = oc_matmul_tf32(c_mod), chosen = -1;
        char v[32] = "";
        if (tf32 >= 0 && fmp != NULL && PyUnicode_Check(fmp))
            chosen = tf32 == 1 || strcmp(oc_utf8(fmp, v, sizeof v), "highest") != 0;
        Py_XDECREF(fmp);
        OC_CLEAR();
        if (chosen < 0)
            snprintf(why, sz, "torch's float32 matmul precision could not be read");
        else if (chosen)
            snprintf(why, sz, "the program chose float32 matmul precision '%s' before CUDA started",
                     v);
        return chosen;
    }
}

/* A step of the CUDA-init callback. */
static void tf32_at_cuda_init(PyObject *torch, PyObject *c_mod)
{
    char why[200];
    int chosen;
    /* A run a Ctrl-C cut short may have written: TF32 on then reads as
     * outofcuda's own setting (a program that chose TF32 itself since then
     * gets the same), found done, and written again. */
    chosen =
        oc_cuda_step_state(OC_STEP_TF32) == OC_STEP_IS_INTERRUPTED && oc_matmul_tf32(c_mod) == 1
            ? 0
            : precision_chosen(c_mod, why, sizeof why);
    if (chosen != 0) {
        oc_record_set(OC_OPT_TF32, OC_REC_SKIPPED,
                      chosen > 0 ? OC_CODE_PROGRAM_CHOSE : OC_CODE_UNREADABLE, "left as it is: %s",
                      why);
    } else if (flags_frozen(torch)) {
        oc_record_set(OC_OPT_TF32, OC_REC_SKIPPED, OC_CODE_FLAGS_FROZEN,
                      "torch.backends.disable_global_flags() was called before CUDA started");
    } else if (set_flag(c_mod, "_set_cublas_allow_tf32", 1, "tf32") != 1) {
        oc_record_set(OC_OPT_TF32, OC_REC_FAILED, OC_CODE_SETTER_FAILED,
                      "torch._C._set_cublas_allow_tf32 failed");
    } else {
        oc_record_set(OC_OPT_TF32, OC_REC_APPLIED, OC_CODE_AT_CUDA_INIT,
                      "set when CUDA initialised (the program had chosen no float32 "
                      "precision): cuBLAS may use TF32 for float32 matmuls; cuDNN TF32 is "
                      "torch's default");
        oc_record_bool(OC_OPT_TF32, 1);
    }
}

static void arm_tf32(const oc_config *cfg, PyObject *torch, PyObject *c_mod, const char *no_queue)
{
    const char *override = oc_env("NVIDIA_TF32_OVERRIDE");
    PyObject *setter;
    if (!cfg->tf32) {
        oc_record_off(OC_OPT_TF32, "OUTOFCUDA_TF32");
        return;
    }
    /* On a CPU-only build the legacy flag still moves torch's float32 matmul
     * precision to "high", which made CPU matmuls slower here: no gain, only
     * harm. */
    if (!build.cuda_build) {
        oc_record_set(OC_OPT_TF32, OC_REC_SKIPPED, OC_CODE_NO_CUDA,
                      "this torch build has no CUDA (TF32 would only slow CPU matmuls)");
        return;
    }
    if (oc_tf32_forced_off(override)) {
        oc_record_set(OC_OPT_TF32, OC_REC_SKIPPED, OC_CODE_TF32_OVERRIDE,
                      "NVIDIA_TF32_OVERRIDE=0 asks for no TF32");
        return;
    }
    if (skip_frozen(torch, OC_OPT_TF32))
        return;
    setter = PyObject_GetAttrString(c_mod, "_set_cublas_allow_tf32");
    if (setter == NULL) {
        OC_CLEAR_RECORDED(); /* the step's reason says torch lacks it */
        oc_record_set(OC_OPT_TF32, OC_REC_SKIPPED, OC_CODE_NO_SETTER,
                      "this torch has no torch._C._set_cublas_allow_tf32");
        return;
    }
    Py_DECREF(setter);
    if (no_queue != NULL) {
        oc_record_set(OC_OPT_TF32, OC_REC_SKIPPED, OC_CODE_NO_QUEUE, "%s", no_queue);
        return;
    }
    oc_cuda_step_arm(OC_STEP_TF32);
    oc_record_set(OC_OPT_TF32, OC_REC_QUEUED, OC_CODE_AT_CUDA_INIT,
                  "queued: cuBLAS TF32 for float32 matmuls when CUDA initialises, unless the "
                  "program has chosen its float32 precision by then");
}

/* cuDNN and SDPA flags are plain fields of torch's context that a CPU-only
 * build has too: libraries read them (Lightning's Trainer(benchmark=None)
 * follows cudnn.benchmark) and users' tests assert torch's defaults, while no
 * kernel of that build uses them. There outofcuda changes nothing readable. */
static int skip_without_cuda(oc_opt opt)
{
    if (build.cuda_build)
        return 0;
    oc_record_set(opt, OC_REC_SKIPPED, OC_CODE_NO_CUDA,
                  "this torch build has no CUDA: torch's default kept");
    return 1;
}

/* A plain flag of oc.h's table (its row names a variable): set on at import
 * where its boolean variable says so, torch's default kept otherwise. */
static void apply_flag(const oc_config *cfg, PyObject *torch, PyObject *c_mod, oc_opt opt)
{
    const oc_opt_row *row = oc_opt_row_of(opt);
    const oc_setting *var = oc_setting_named(row->var);
    int on = 0;
    if (var != NULL && var->kind == OC_SET_BOOL && var->offset != OC_NO_FIELD)
        memcpy(&on, (const char *)cfg + var->offset, sizeof on); /* an int field (settings.c) */
    if (!on)
        oc_record_off(opt, row->var);
    else if (skip_without_cuda(opt) || skip_frozen(torch, opt))
        return;
    else if (set_flag(c_mod, row->setter, 1, row->name) != 1)
        oc_record_set(opt, OC_REC_SKIPPED, OC_CODE_NO_SETTER, "this torch has no torch._C.%s",
                      row->setter);
    else {
        oc_record_set(opt, OC_REC_APPLIED,
                      oc_env(row->var) ? OC_CODE_USER_SETTING : OC_CODE_DEFAULT, "%s", row->does);
        oc_record_bool(opt, 1);
    }
}

/* Deterministic cuDNN needs fixed algorithms, so it turns the autotuner off
 * too. Returns 1 when it did so while the autotuner was on (its record then
 * says why). */
static int apply_deterministic(const oc_config *cfg, PyObject *torch, PyObject *c_mod)
{
    const oc_opt det = OC_OPT_CUDNN_DETERMINISTIC, bench = OC_OPT_CUDNN_BENCHMARK;
    if (oc_config_off(cfg, "OUTOFCUDA_CUDNN_DETERMINISTIC")) {
        oc_record_off(det, "OUTOFCUDA_CUDNN_DETERMINISTIC");
        return 0;
    }
    if (skip_without_cuda(det) || skip_frozen(torch, det))
        return 0;
    if (!cfg->cudnn_deterministic) {
        oc_record_set(det, OC_REC_SKIPPED, OC_CODE_DEFAULT,
                      "OUTOFCUDA_CUDNN_DETERMINISTIC=0 (default)");
        oc_record_bool(det, 0);
        return 0;
    }
    if (set_flag(c_mod, oc_opt_row_of(det)->setter, 1, "cudnn_deterministic") == 1) {
        oc_record_set(det, OC_REC_APPLIED, OC_CODE_USER_SETTING, "OUTOFCUDA_CUDNN_DETERMINISTIC=1");
        oc_record_bool(det, 1);
    } else {
        oc_record_set(det, OC_REC_SKIPPED, OC_CODE_NO_SETTER, "torch._C has no cuDNN setter");
    }
    if (set_flag(c_mod, oc_opt_row_of(bench)->setter, 0, "cudnn_benchmark") != 1 ||
        !cfg->cudnn_benchmark)
        return 0;
    oc_record_set(bench, OC_REC_SKIPPED, OC_CODE_DETERMINISTIC,
                  "forced off: deterministic cuDNN needs fixed algorithms");
    oc_record_bool(bench, 0);
    return 1;
}

/* flash, memory-efficient and math attention are on by default in every
 * release this covers: only a backend the user turned off is written, since
 * each write of a default is one more flag torch records as set. cuDNN
 * attention is left as torch has it. */
static void apply_sdpa(const oc_config *cfg, PyObject *c_mod)
{
    static const char *const fns[] = {"_set_sdp_use_flash", "_set_sdp_use_mem_efficient",
                                      "_set_sdp_use_math"};
    const int want[] = {cfg->flash_attn, cfg->mem_eff_attn, cfg->math_attn};
    int off = 0, done = 0;
    if (skip_without_cuda(OC_OPT_SDPA))
        return;
    for (int i = 0; i < 3; i++) {
        if (want[i])
            continue;
        off++;
        done += set_flag(c_mod, fns[i], 0, "sdpa") == 1;
    }
    if (off == 0) {
        /* record.c adds what became of cuDNN attention (the known-bugs
         * guard decides that when CUDA starts). */
        oc_record_set(OC_OPT_SDPA, OC_REC_SKIPPED, OC_CODE_TORCH_DEFAULT,
                      "torch's default: flash, memory-efficient and math attention are on "
                      "(nothing written)");
        oc_record_sdpa(want[0], want[1], want[2]);
    } else if (done != off) {
        oc_record_set(OC_OPT_SDPA, OC_REC_SKIPPED, OC_CODE_NO_SETTER,
                      "this torch lacks the SDPA backend setters");
    } else {
        oc_record_set(OC_OPT_SDPA, OC_REC_APPLIED, OC_CODE_USER_SETTING, "%s",
                      want[2] ? "backends turned off as configured (OUTOFCUDA_*_ATTN=0)"
                              : "math backend off: some inputs may find no kernel");
        oc_record_sdpa(want[0], want[1], want[2]);
    }
}

/* ---- torch's runtime allocator setter ---- */

/* A framework was imported after torch (a script that imports torch, then
 * vllm, then uses CUDA): at CUDA initialisation, before the first
 * allocation, torch's allocator gets back exactly the user's own string.
 * torch's parser (AcceleratorAllocatorConfig::parseArgs, and the CUDA one
 * before it) resets max_split_size, roundup_power2_divisions and
 * garbage_collection_threshold when a string leaves them out, but keeps
 * expandable_segments (measured on 2.14.1): where outofcuda turned it on
 * and the user's string does not name it, it is turned off first. The
 * `backend` key was read when torch loaded and stays. */
static void hand_back_allocator(PyObject *c_mod)
{
    const oc_framework_choice *fw = oc_framework_choice_get();
    const char *name, *user, *used;
    int rc = 1;
    if (oc_config_off(oc_config_get(), "OUTOFCUDA_ALLOC_CONF"))
        return; /* the record says off: there is nothing of outofcuda's to hand back */
    if (!alloc_applied) {
        oc_record_set(OC_OPT_ALLOCATOR, OC_REC_SKIPPED, OC_CODE_FRAMEWORK,
                      "%s; left to %s from CUDA initialisation. %s", alloc_reason, fw->left_to,
                      fw->why);
        oc_record_notes(OC_OPT_ALLOCATOR, alloc_notes, alloc_variable, alloc_left_out);
        return;
    }
    name = user_alloc_var(&user);
    if (oc_alloc_expandable(alloc_value) &&
        oc_alloc_value(user, "expandable_segments", NULL, 0) != 1)
        rc = oc_alloc_call_setter(c_mod, "expandable_segments:False", &used);
    if (rc == 1)
        rc = oc_alloc_call_setter(c_mod, user, &used);
    if (rc != 1) {
        oc_set_error("handing the user's allocator settings back to torch at CUDA "
                     "initialisation");
        if (oc_interrupt_waiting())
            return; /* not refused: the step runs again */
        oc_record_set(OC_OPT_ALLOCATOR, OC_REC_APPLIED, OC_CODE_SETTER_FAILED,
                      "%s; %s is in use but torch's setter refused the user's %s, so "
                      "outofcuda's settings stay",
                      alloc_reason, fw->left_to, name);
        oc_record_notes(OC_OPT_ALLOCATOR, alloc_notes, alloc_variable, alloc_left_out);
        return;
    }
    oc_record_set(OC_OPT_ALLOCATOR, OC_REC_SKIPPED, OC_CODE_HANDED_BACK,
                  "handed back at CUDA initialisation: torch's allocator holds the user's own %s "
                  "('%.200s'), left to %s. %s",
                  name, user, fw->left_to, fw->why);
}

/* The fraction the fraction step sets, when armed: at import, or by
 * framework_left. */
static double pending_fraction;

/* The framework found at torch's import is gone when CUDA initialises: its
 * own import failed after it imported torch (a vLLM built for another
 * torch), so nothing in the process owns GPU memory. outofcuda's merge,
 * worked out at import, goes to torch's runtime setter now, before the
 * first allocation, and the fraction step that follows sets the fraction. */
static void framework_left(PyObject *c_mod, const char *gone)
{
    char reason[400];
    const char *user, *used = NULL;
    int rc = 1;
    oc_framework_leave_to(NULL, NULL);
    oc_framework_decided(1, OC_FW_GONE);
    snprintf(reason, sizeof reason,
             "%s, in use when torch imported, was gone when CUDA initialised (its import failed)",
             gone);
    user_alloc_var(&user);
    if (alloc_value[0] && strcmp(alloc_value, user) != 0)
        rc = oc_alloc_call_setter(c_mod, alloc_value, &used);
    if (oc_config_off(oc_config_get(), "OUTOFCUDA_ALLOC_CONF")) {
        /* the record already says off */
    } else if (rc != 1) {
        oc_set_error("handing the allocator settings to torch at CUDA initialisation");
        if (oc_interrupt_waiting())
            return; /* not refused: the step runs again */
        oc_record_set(OC_OPT_ALLOCATOR, OC_REC_FAILED,
                      used ? OC_CODE_SETTER_FAILED : OC_CODE_NO_SETTER,
                      "%s; torch's runtime setter %s", reason, used ? "failed" : "is missing");
    } else if (used == NULL) {
        oc_record_set(OC_OPT_ALLOCATOR, OC_REC_SKIPPED, OC_CODE_NOTHING_TO_ADD,
                      "%s; nothing to add to the user's allocator settings", reason);
    } else {
        oc_record_set(OC_OPT_ALLOCATOR, OC_REC_APPLIED, OC_CODE_FRAMEWORK_LEFT,
                      "given to torch._C.%s when CUDA initialised: %s", used, reason);
        oc_record_text(OC_OPT_ALLOCATOR, alloc_value);
    }
    if (build.cuda_build && !oc_config_off(oc_config_get(), "OUTOFCUDA_MEMORY_FRACTION")) {
        pending_fraction = oc_config_get()->memory_fraction;
        oc_cuda_step_arm(OC_STEP_FRACTION);
    }
}

/* A step of the CUDA-init callback, the first. Frameworks are looked at
 * again, since what counts is what is true when CUDA starts: one found at
 * torch's import may be gone (framework_left), one imported after torch is
 * found now; then torch's allocator is handed back and the memory fraction
 * (the next step) is left to the framework. What import found
 * (left_at_import, alloc_applied) is read, never changed. */
static void framework_at_cuda_init(PyObject *c_mod)
{
    const oc_framework_choice *fw = oc_framework_choice_get();
    if (left_at_import[0]) {
        if (oc_framework_in_use(NULL, 0) == NULL)
            framework_left(c_mod, left_at_import);
        else
            oc_framework_decided(1, OC_FW_LEFT_TO);
        return;
    }
    if (!framework_owns_memory(oc_config_get(), NULL, 0)) {
        oc_framework_decided(1, oc_framework_in_use(NULL, 0) ? OC_FW_OVERRIDE : OC_FW_NONE);
        return;
    }
    /* imported after torch: the allocator is handed back, the fraction left to it */
    oc_framework_decided(1, OC_FW_LEFT_TO);
    hand_back_allocator(c_mod);
    if (oc_config_off(oc_config_get(), "OUTOFCUDA_MEMORY_FRACTION"))
        return; /* the record says off */
    oc_record_set(OC_OPT_FRACTION, OC_REC_SKIPPED, OC_CODE_FRAMEWORK, "not set: left to %s. %s",
                  fw->left_to, fw->why);
}

/* ---- memory fraction, deferred to CUDA initialisation ---- */

/* torch's allocator key per_process_memory_fraction (2.10+) is the program's
 * own fraction: torch's allocator takes it when it starts, before the
 * lazy-init queue runs, where outofcuda's would overwrite it. Returns it, with
 * where in `where` (*var the variable, else NULL), when the user's allocator
 * variable holds the key or, at
 * CUDA's start (c_mod given), torch's settings getter (2.12+) shows it or
 * `device`'s allocator holds a fraction below 1 (a runtime setter's on 2.10
 * and 2.11, which have no getter) other than outofcuda's own (set by a run of
 * this step a Ctrl-C cut short, the queue then run again: own); -1 when none. */
static double program_fraction(PyObject *c_mod, long device, double own, const char **var,
                               char *where, size_t sz)
{
    const char *user;
    char v[64], conf[OC_ALLOC_CONF_MAX];
    PyObject *live;
    double held;
    *var = user_alloc_var(&user);
    if (oc_alloc_value(user, "per_process_memory_fraction", v, sizeof v) == 1)
        return snprintf(where, sz, "%s sets per_process_memory_fraction:%s", *var, v) > 0 ? atof(v)
                                                                                          : -1.0;
    *var = NULL;
    if (c_mod == NULL)
        return -1.0;
    live = oc_call_quiet(c_mod, "_accelerator_getAllocatorSettings", NULL, NULL);
    oc_utf8(live != NULL && PyUnicode_Check(live) ? live : NULL, conf, sizeof conf);
    Py_XDECREF(live);
    if (oc_alloc_value(conf, "per_process_memory_fraction", v, sizeof v) == 1)
        return snprintf(where, sz, "torch's settings hold per_process_memory_fraction:%s", v) > 0
                   ? atof(v)
                   : -1.0;
    live = PyObject_CallMethod(c_mod, "_cuda_getMemoryFraction", "l", device);
    held = live != NULL && PyFloat_Check(live) ? PyFloat_AsDouble(live) : 1.0;
    OC_CLEAR_ABSENT(); /* a torch without the reader holds none */
    Py_XDECREF(live);
    return held > 0.0 && held < 1.0 && (held - own) * (held - own) > 1e-12 &&
                   snprintf(where, sz,
                            "torch's allocator holds a memory fraction of %.2f for cuda:%ld", held,
                            device) > 0
               ? held
               : -1.0;
}

/* Records the memory fraction as left to the program's own and returns 1
 * when program_fraction finds one; 0 otherwise. */
static int fraction_left_to_program(PyObject *c_mod, long device, double own, const char *what,
                                    const char *torch_does)
{
    char where[200];
    const char *var;
    double chosen = program_fraction(c_mod, device, own, &var, where, sizeof where);
    if (chosen < 0.0)
        return 0;
    oc_record_set(OC_OPT_FRACTION, OC_REC_SKIPPED, OC_CODE_PROGRAM_CHOSE,
                  "%s: %s, which torch %s (the user's fraction wins over "
                  "OUTOFCUDA_MEMORY_FRACTION)",
                  what, where, torch_does);
    oc_record_chosen(chosen, var);
    return 1;
}

/* OUTOFCUDA_MEMORY_FRACTION=auto: leaves 2 % of cuda:device's memory (NVML's
 * total), 768 MiB to 2 GiB and at most a quarter, to what lives outside torch's
 * allocator (docs/what-it-changes.md, "The memory cap"); 0.95 where NVML cannot
 * tell (no NVML; a MIG instance, whose NVML figures are the GPU's). */
static double auto_fraction(long device, char *sized, size_t sz)
{
    const char *vis = oc_env("CUDA_VISIBLE_DEVICES");
    double total, headroom;
    char a[32], b[32];
    oc_gpu_info g;
    if ((vis != NULL && strstr(vis, "MIG-") != NULL) ||
        oc_nvml_device_info(oc_nvml_index((int)device), &g) != 0 || g.total == 0) {
        snprintf(sized, sz, " (auto: the board's size unknown, 0.95 of it)");
        return 0.95;
    }
    total = (double)g.total;
    headroom = total / 50.0 < 768.0 * (1 << 20) ? 768.0 * (1 << 20)
               : total / 50.0 > OC_GIB * 2.0    ? OC_GIB * 2.0
                                                : total / 50.0;
    headroom = headroom > total / 4.0 ? total / 4.0 : headroom;
    oc_fmt_bytes((unsigned long long)headroom, a, sizeof a);
    oc_fmt_bytes(g.total, b, sizeof b);
    snprintf(sized, sz, " (auto: %s of its %s left outside torch's allocator)", a, b);
    return 1.0 - headroom / total;
}

/* A step of the CUDA-init callback: this process's device only. */
static void fraction_at_cuda_init(PyObject *c_mod)
{
    PyObject *n = NULL, *dev = NULL, *r = NULL;
    long rank = oc_env_rank("LOCAL_RANK"), count = 0, device = 0;
    double fraction = pending_fraction;
    char sized[120] = "";
    if (oc_framework_choice_get()->left_to[0])
        return; /* the framework step (first) left the fraction to a framework */
    n = PyObject_CallMethod(c_mod, "_cuda_getDeviceCount", NULL);
    if (n == NULL)
        goto error;
    count = PyLong_AsLong(n);
    if (rank >= 0 && rank < count) {
        device = rank;
    } else {
        dev = PyObject_CallMethod(c_mod, "_cuda_getDevice", NULL);
        if (dev == NULL)
            goto error;
        device = PyLong_AsLong(dev);
    }
    if (fraction < 0.0)
        fraction = auto_fraction(device, sized, sizeof sized);
    if (fraction_left_to_program(c_mod, device, fraction, "not set when CUDA initialised",
                                 "applied then"))
        goto done;
    r = PyObject_CallMethod(c_mod, "_cuda_setMemoryFraction", "dl", fraction, device);
    if (r == NULL)
        goto error;
    oc_record_set(OC_OPT_FRACTION, OC_REC_APPLIED, OC_CODE_AT_CUDA_INIT,
                  "applied to cuda:%ld when CUDA initialised%s%s", device,
                  rank >= 0 && rank == device ? " (LOCAL_RANK)" : "", sized);
    oc_record_fraction(fraction, device);
    oc_record_notes(OC_OPT_FRACTION, rank >= 0 && rank == device ? 1u << OC_NOTE_LOCAL_RANK : 0,
                    NULL, NULL);
    goto done;
error:
    /* oc_set_error sets an interrupt aside instead of recording it: no
     * failure then: the step stays armed, its record says interrupted. */
    oc_set_error("memory fraction at CUDA initialisation");
    if (!oc_interrupt_waiting())
        oc_record_set(OC_OPT_FRACTION, OC_REC_FAILED, OC_CODE_ERROR,
                      "setting it when CUDA initialised failed (status()['error'])");
done:
    OC_CLEAR();
    Py_XDECREF(r);
    Py_XDECREF(dev);
    Py_XDECREF(n);
}

static void arm_memory_fraction(const oc_config *cfg, const char *no_queue)
{
    const oc_framework_choice *fw = oc_framework_choice_get();
    if (oc_config_off(cfg, "OUTOFCUDA_MEMORY_FRACTION")) {
        oc_record_off(OC_OPT_FRACTION, "OUTOFCUDA_MEMORY_FRACTION");
        return;
    }
    if (!build.cuda_build) {
        oc_record_set(OC_OPT_FRACTION, OC_REC_SKIPPED, OC_CODE_NO_CUDA,
                      "this torch build has no CUDA");
        return;
    }
    if (no_queue != NULL) {
        oc_record_set(OC_OPT_FRACTION, OC_REC_SKIPPED, OC_CODE_NO_QUEUE, "%s", no_queue);
        return;
    }
    if (fw->left_to[0]) {
        oc_record_set(OC_OPT_FRACTION, OC_REC_SKIPPED, OC_CODE_FRAMEWORK, "not set: left to %s. %s",
                      fw->left_to, fw->why);
        return;
    }
    if (fraction_left_to_program(NULL, 0, 0.0, "not set", "applies when CUDA initialises"))
        return;
    pending_fraction = cfg->memory_fraction;
    oc_cuda_step_arm(OC_STEP_FRACTION);
    oc_record_set(OC_OPT_FRACTION, OC_REC_QUEUED, OC_CODE_AT_CUDA_INIT,
                  "queued: applied to this process's device when CUDA initialises%s",
                  pending_fraction < 0.0 ? ", sized by its memory" : "");
    oc_record_fraction(cfg->memory_fraction, -1);
}

/* ---- the one callback at CUDA initialisation ----
 *
 * Everything outofcuda does when CUDA starts runs from this one callback,
 * queued with torch.cuda._lazy_call, in this order: the framework check (a
 * framework that owns GPU memory gets torch's allocator back and keeps the
 * memory fraction to itself), TF32 (only where the program chose no
 * precision), the memory fraction, the known-bug guards, the OOM observer and
 * exception hooks, the summary sampler. The rules, for every step: it runs
 * inside torch.cuda._lazy_init, on whichever thread first
 * touches CUDA (or at once, when CUDA was already initialised at queueing);
 * it must not raise (torch turns that into DeferredCudaCallError and the
 * initialisation fails) and must not call torch.cuda._lazy_call (from torch
 * 2.6 _lazy_init runs the queue while holding _initialization_lock, a plain
 * threading.Lock that _lazy_call takes too: the thread would wait on itself
 * for ever). A step runs only when armed (oc_cuda_step_arm), and is done
 * only when it completed: its bit is cleared after it ran to the end. A step
 * during which a Ctrl-C (or a SystemExit) arrived stays armed and the
 * callback stops there: the interrupt reaches the program as the callback
 * returns, torch keeps its queue after a raising callback and runs it again
 * at the next CUDA call, and the step runs again then, from its start. So
 * every step decides from what import left and torch's own flags, never from
 * what an earlier run of its own changed, and writes torch's settings, its
 * records and its part of the framework decision whole (a write that finds
 * its work already done counts it as done). A step that completed never
 * runs again, though a stand-in torch or a queue run by hand may call the
 * callback again. */

static int step_armed(oc_cuda_step step)
{
    return (oc_cuda_steps_armed() & (1u << step)) != 0;
}

/* The record a step decides, which says interrupted while the step waits
 * to run again (OC_OPT_COUNT: none of its own). */
static oc_opt step_record(oc_cuda_step step)
{
    return step == OC_STEP_TF32       ? OC_OPT_TF32
           : step == OC_STEP_FRACTION ? OC_OPT_FRACTION
           : step == OC_STEP_OOM      ? OC_OPT_OOM
                                      : OC_OPT_COUNT;
}

static void run_step(oc_cuda_step step, PyObject *torch, PyObject *c_mod)
{
    switch (step) {
    case OC_STEP_FRAMEWORK:
        framework_at_cuda_init(c_mod);
        break;
    case OC_STEP_TF32:
        tf32_at_cuda_init(torch, c_mod);
        break;
    case OC_STEP_FRACTION: /* armed at import or by the framework step */
        fraction_at_cuda_init(c_mod);
        break;
    case OC_STEP_KNOWN_BUGS:
        oc_known_bugs_at_cuda_init(torch);
        break;
    case OC_STEP_OOM:
        oc_oom_at_cuda_init(torch);
        break;
    case OC_STEP_SUMMARY:
        oc_summary_at_cuda_init();
        break;
    case OC_STEP_COUNT: /* no default: -Wswitch names a step of oc.h without its case */
        break;
    }
    OC_CLEAR();
}

static PyObject *py_at_cuda_init(PyObject *self, PyObject *unused)
{
    PyObject *torch = oc_sys_module("torch");
    PyObject *c_mod = torch ? PyObject_GetAttrString(torch, "_C") : NULL;
    int interrupted;
    (void)self;
    (void)unused;
    OC_CLEAR(); /* no torch._C (never armed then): nothing runs */
    for (int i = 0; c_mod != NULL && i < OC_STEP_COUNT && !oc_interrupt_waiting(); i++) {
        oc_cuda_step step = (oc_cuda_step)i;
        if (!step_armed(step))
            continue;
        run_step(step, torch, c_mod);
        interrupted = oc_interrupt_waiting();
        if (interrupted)
            oc_record_set(step_record(step), OC_REC_INTERRUPTED, OC_CODE_AT_CUDA_INIT,
                          "interrupted when CUDA initialised: runs again with torch's queue");
        oc_cuda_step_ran(step, interrupted);
    }
    OC_CLEAR();
    Py_XDECREF(c_mod);
    Py_XDECREF(torch);
    Py_RETURN_NONE;
}

OC_EDGE_NOARGS(py_at_cuda_init)
static PyMethodDef at_cuda_init_def = OC_METHOD("outofcuda_at_cuda_init", py_at_cuda_init, NULL);

/* torch.cuda._lazy_call, or NULL with *why_not saying why (a reason, static
 * storage). */
static PyObject *lazy_call_fn(PyObject *torch, const char **why_not)
{
    PyObject *fn = oc_getattr_chain(torch, "cuda._lazy_call");
    OC_CLEAR_RECORDED(); /* *why_not says why */
    *why_not = fn ? NULL : "this torch has no torch.cuda._lazy_call";
    return fn;
}

/* Queues the callback. Returns 0, or -1 (recorded as outofcuda's error). */
static int queue_at_cuda_init(PyObject *lazy_call)
{
    PyObject *cb = PyCFunction_NewEx(&at_cuda_init_def, NULL, NULL);
    PyObject *r = cb ? PyObject_CallFunctionObjArgs(lazy_call, cb, NULL) : NULL;
    Py_XDECREF(cb);
    if (r == NULL) {
        oc_set_error("queueing outofcuda's CUDA-init callback");
        OC_CLEAR_RECORDED(); /* by oc_set_error */
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* ---- autocast dtype ---- */

static void apply_amp_dtype(const oc_config *cfg, PyObject *torch)
{
    char why[260] = "", reason[300];
    const char *dtype_name;
    PyObject *dtype, *fn, *r;
    int use_new;
    if (cfg->amp_dtype == OC_AMP_OFF) {
        oc_record_off(OC_OPT_AMP_DTYPE, "OUTOFCUDA_AMP_DTYPE");
        return;
    }
    if (!build.cuda_build) {
        oc_record_set(OC_OPT_AMP_DTYPE, OC_REC_SKIPPED, OC_CODE_NO_CUDA,
                      "this torch build has no CUDA");
        return;
    }
    dtype_name = oc_amp_cuda_dtype(cfg, why, sizeof why);
    if (dtype_name == NULL) {
        oc_record_set(OC_OPT_AMP_DTYPE, OC_REC_SKIPPED, OC_CODE_DTYPE_UNKNOWN, "%s", why);
        return;
    }
    snprintf(reason, sizeof reason, "%s%s", cfg->amp_dtype == OC_AMP_AUTO ? "auto: " : "", why);
    dtype = PyObject_GetAttrString(torch, dtype_name);
    /* 2.4 added set_autocast_dtype(device, dtype) and deprecated the GPU one. */
    fn = PyObject_GetAttrString(torch, "set_autocast_dtype");
    use_new = fn != NULL;
    if (fn == NULL) {
        OC_CLEAR_ABSENT(); /* an older torch, the GPU setter is tried */
        fn = PyObject_GetAttrString(torch, "set_autocast_gpu_dtype");
    }
    if (dtype == NULL || fn == NULL) {
        OC_CLEAR();
        Py_XDECREF(dtype);
        Py_XDECREF(fn);
        oc_record_set(OC_OPT_AMP_DTYPE, OC_REC_SKIPPED, OC_CODE_NO_SETTER,
                      "this torch has no autocast dtype setter");
        return;
    }
    r = use_new ? PyObject_CallFunction(fn, "sO", "cuda", dtype)
                : PyObject_CallFunctionObjArgs(fn, dtype, NULL);
    Py_DECREF(fn);
    Py_DECREF(dtype);
    if (r == NULL) {
        oc_set_error("setting the autocast dtype");
        oc_record_set(OC_OPT_AMP_DTYPE, OC_REC_FAILED, OC_CODE_SETTER_FAILED,
                      "the autocast dtype setter failed");
        return;
    }
    Py_DECREF(r);
    oc_record_set(OC_OPT_AMP_DTYPE, OC_REC_APPLIED,
                  cfg->amp_dtype == OC_AMP_AUTO ? OC_CODE_DEFAULT : OC_CODE_USER_SETTING, "%s",
                  reason);
    oc_record_text(OC_OPT_AMP_DTYPE, dtype_name);
    if (cfg->amp_dtype == OC_AMP_AUTO)
        oc_record_capability(oc_nvml_min_visible_cc());
    if (cfg->amp_dtype == OC_AMP_AUTO && strcmp(dtype_name, "bfloat16") == 0)
        oc_record_cost(OC_OPT_AMP_DTYPE, OC_COST_BF16_CONV);
}

/* Hands torch the merged string through its runtime setter, then gives the
 * variable back to the user. torch 2.14.1 parses every key but `backend`
 * lazily, on the first allocation or settings call (measured: a variable
 * deleted right after `import torch` leaves _accelerator_getAllocatorSettings()
 * empty), so without the setter the variable would have to stay set for the
 * whole process, and every child would inherit it. The setter parses into
 * the allocator's configuration without initialising CUDA; the `backend`
 * key was read from the variable while torch's libraries loaded. */
static void settle_allocator(PyObject *c_mod)
{
    const char *used = NULL;
    size_t len;
    int rc;
    if (!alloc_saved.written && !alloc_by_setter)
        return;
    rc = oc_alloc_call_setter(c_mod, alloc_value, &used);
    len = strlen(alloc_reason);
    if (rc != 1) {
        if (rc < 0)
            oc_set_error("handing the allocator settings to torch");
        OC_CLEAR_RECORDED(); /* above, or no setter: the reason says so */
        alloc_applied = 0;
        alloc_code = used ? OC_CODE_SETTER_FAILED : OC_CODE_NO_SETTER;
        snprintf(alloc_reason + len, sizeof alloc_reason - len, "; not in effect: %s%s",
                 used ? "torch's setter failed" : "this torch has no runtime allocator setter",
                 alloc_by_setter ? "" : ", so the variable was restored");
    } else {
        snprintf(alloc_reason + len, sizeof alloc_reason - len, "; given to torch._C.%s", used);
        alloc_notes |= alloc_by_setter ? 0 : 1u << OC_NOTE_RESTORED;
    }
    alloc_by_setter = 0;
    restore_allocator_env();
}

/* garbage_collection_threshold acts only under a memory limit: the
 * allocator collects cached blocks in malloc() only when a fraction is set
 * (`set_fraction` up to 2.10; from 2.11, with per_process_memory_fraction,
 * `allowed_memory_maximum`, which a fraction of 1 leaves empty: no limit).
 * Says so in the allocator's reason where the threshold cannot act. */
static void note_idle_gc(const oc_config *cfg)
{
    char v[32];
    const char *why = NULL;
    size_t len = strlen(alloc_reason);
    if (oc_alloc_value(alloc_value, "garbage_collection_threshold", v, sizeof v) != 1 ||
        atof(v) <= 0.0)
        return;
    if (oc_alloc_value(alloc_value, "per_process_memory_fraction", v, sizeof v) == 1 &&
        atof(v) < 1.0)
        return;
    if (oc_config_off(cfg, "OUTOFCUDA_MEMORY_FRACTION"))
        why = "OUTOFCUDA_MEMORY_FRACTION is off";
    else if (cfg->memory_fraction >= 1.0 && build.ver >= 21100)
        why = "OUTOFCUDA_MEMORY_FRACTION=1 sets no limit on this torch";
    if (why == NULL)
        return;
    alloc_notes |= 1u << OC_NOTE_GC_THRESHOLD_IDLE;
    snprintf(alloc_reason + len, sizeof alloc_reason - len,
             "; garbage_collection_threshold cannot act: torch's allocator collects cached "
             "blocks only under a memory fraction below 1, and %s (unless the program sets one)",
             why);
}

static void record_allocator(const oc_config *cfg)
{
    if (oc_config_off(cfg, "OUTOFCUDA_ALLOC_CONF")) {
        oc_record_off(OC_OPT_ALLOCATOR, "OUTOFCUDA_ALLOC_CONF");
        return;
    }
    if (!prepared) {
        /* A build without CUDA has no CUDA allocator to miss: say that, as
         * the hook would have, rather than blame the order. */
        if (build.known && !build.cuda_build)
            oc_record_set(OC_OPT_ALLOCATOR, OC_REC_SKIPPED, OC_CODE_NO_CUDA,
                          "this torch build has no CUDA");
        else
            oc_record_set(OC_OPT_ALLOCATOR, OC_REC_SKIPPED, OC_CODE_IMPORTED_EARLY,
                          "torch was imported before outofcuda's hook installed; the allocator "
                          "variable must be set before torch loads (call outofcuda.apply() "
                          "before import torch)");
        return;
    }
    if (alloc_applied)
        note_idle_gc(cfg);
    oc_record_set(OC_OPT_ALLOCATOR,
                  alloc_applied ? OC_REC_APPLIED
                  : alloc_code == OC_CODE_ERROR || alloc_code == OC_CODE_SETTER_FAILED ||
                          alloc_code == OC_CODE_NO_SETTER
                      ? OC_REC_FAILED
                      : OC_REC_SKIPPED,
                  alloc_code, "%s", alloc_reason);
    oc_record_notes(OC_OPT_ALLOCATOR,
                    alloc_notes |
                        (alloc_generic && alloc_applied ? 1u << OC_NOTE_GENERIC_VARIABLE : 0),
                    alloc_variable, alloc_left_out);
    if (alloc_value[0] && alloc_applied)
        oc_record_text(OC_OPT_ALLOCATOR, alloc_value);
}

void oc_bridge_after_torch(PyObject *torch)
{
    const oc_config *cfg = oc_config_get();
    PyObject *c_mod, *v, *lazy_call;
    const char *no_queue;
    int forced;
    v = PyObject_GetAttrString(torch, "__version__");
    if (v != NULL) {
        PyObject *text = PyObject_Str(v);
        oc_report_torch_version(text);
        Py_XDECREF(text);
        Py_DECREF(v);
    }
    OC_CLEAR();
    c_mod = PyObject_GetAttrString(torch, "_C");
    OC_CLEAR(); /* none: not PyTorch (below) */
    settle_allocator(c_mod);
    if (cfg->disable) {
        Py_XDECREF(c_mod);
        oc_record_set_all(OC_REC_SKIPPED, OC_CODE_OFF, OC_DISABLED_TEXT);
        return;
    }
    read_version_module(torch);
    if (c_mod == NULL) {
        /* A `torch.py` of the user's own (or a stub) is not PyTorch: that is
         * no failure of outofcuda's, so no warning, only the record. */
        oc_record_set_all(OC_REC_SKIPPED, OC_CODE_NOT_PYTORCH,
                          "the imported `torch` is not PyTorch (it has no torch._C)");
        return;
    }
    lazy_call = lazy_call_fn(torch, &no_queue);
    arm_tf32(cfg, torch, c_mod, no_queue);
    forced = apply_deterministic(cfg, torch, c_mod);
    for (int i = 0; i < OC_OPT_COUNT; i++) {
        if (oc_opt_row_of((oc_opt)i)->var != NULL && !(forced && i == OC_OPT_CUDNN_BENCHMARK))
            apply_flag(cfg, torch, c_mod, (oc_opt)i);
    }
    record_allocator(cfg);
    arm_memory_fraction(cfg, no_queue);
    /* The framework step may have to hand torch's allocator back, or to
     * look again at a framework found at import. */
    if ((alloc_applied || oc_framework_choice_get()->left_to[0]) && no_queue == NULL)
        oc_cuda_step_arm(OC_STEP_FRAMEWORK);
    apply_sdpa(cfg, c_mod);
    oc_known_bugs_at_import(torch, no_queue);
    apply_amp_dtype(cfg, torch);
    oc_oom_install(torch, no_queue);
    oc_summary_prepare(
        build.cuda_build && no_queue == NULL,
        &(oc_summary_torch){build.cuda_build, build.hip_build, oc_alloc_expandable(alloc_value)});
    /* The framework step runs whenever the callback does: a framework
     * imported after torch counts too. */
    if (oc_cuda_steps_armed())
        oc_cuda_step_arm(OC_STEP_FRAMEWORK);
    if (oc_cuda_steps_armed() && queue_at_cuda_init(lazy_call) < 0) {
        /* Nothing will run when CUDA starts: no step may still say queued. */
        for (int i = 0; i < OC_STEP_COUNT; i++) {
            if (step_armed((oc_cuda_step)i))
                oc_record_set(step_record((oc_cuda_step)i), OC_REC_FAILED, OC_CODE_QUEUE_FAILED,
                              "torch.cuda._lazy_call failed: left as torch has it");
        }
        oc_cuda_steps_set_armed(0);
    }
    Py_XDECREF(lazy_call);
    Py_DECREF(c_mod);
    OC_CLEAR();
    if (cfg->verbose)
        oc_report_verbose();
}
