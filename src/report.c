/* report.c - what outofcuda did: the status() dict and the verbose table. */
#include "oc.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* What status() shows of the hook, told by the files above that decide it:
 * the finder is on sys.meta_path (watcher.c), the torch callback ran
 * (watcher.c), and torch's __version__ as str (bridge.c), or NULL. */
static struct {
    int installed, fired;
    PyObject *torch_version;
} hook;

void oc_report_hook_installed(void)
{
    hook.installed = 1;
}

int oc_report_hook_fired(void)
{
    int was = hook.fired;
    hook.fired = 1;
    return was;
}

int oc_report_hook_has_fired(void)
{
    return hook.fired;
}

void oc_report_torch_version(PyObject *version)
{
    PyObject *old = hook.torch_version;
    Py_XINCREF(version);
    hook.torch_version = version;
    Py_XDECREF(old);
}

/* Returns 1 when sys.modules holds a torch that finished importing. Reads
 * sys.modules and the module's dict only: an attribute lookup (including
 * PyImport_GetModule's own look at __spec__) would execute a torch that
 * importlib.util.LazyLoader holds unexecuted. */
static int torch_imported(void)
{
    PyObject *modules = PySys_GetObject("modules"); /* borrowed */
    PyObject *torch = modules && PyDict_Check(modules) ? PyDict_GetItemString(modules, "torch")
                                                       : NULL;                     /* borrowed */
    PyObject *d = torch && PyModule_Check(torch) ? PyModule_GetDict(torch) : NULL; /* borrowed */
    PyObject *spec = d ? PyDict_GetItemString(d, "__spec__") : NULL;               /* borrowed */
    PyObject *initializing = NULL;
    int done = 0;
    if (d != NULL && PyDict_GetItemString(d, "__version__") != NULL) {
        initializing =
            spec && spec != Py_None ? PyObject_GetAttrString(spec, "_initializing") : NULL;
        done = initializing == NULL || PyObject_IsTrue(initializing) != 1;
    }
    OC_CLEAR();
    Py_XDECREF(initializing);
    return done;
}

/* Why nothing is recorded yet (the sentence; *code the code). */
static const char *pending_reason(oc_rec_code *code)
{
    if (hook.installed && !hook.fired && torch_imported()) {
        *code = OC_CODE_IMPORT_BYPASSED;
        return "torch was imported without passing outofcuda's import watcher (a finder ahead "
               "of it on sys.meta_path loaded torch): nothing was applied";
    }
    if (hook.installed && !hook.fired) {
        *code = OC_CODE_NOT_IMPORTED;
        return "torch has not been imported in this process yet";
    }
    if (oc_disabled_by_env()) {
        *code = OC_CODE_OFF;
        return OC_DISABLED_TEXT;
    }
    *code = OC_CODE_NO_HOOK;
    return "the start-up hook did not run in this process (python -S, or the hook file is "
           "missing: run `outofcuda doctor`)";
}

/* A record's value as status() gives it (new ref). */
static PyObject *record_value(const oc_record *r)
{
    switch (r->kind) {
    case OC_VAL_BOOL:
        return PyBool_FromLong(r->flag);
    case OC_VAL_MATMUL:
        return Py_BuildValue("{s:N}", "matmul", PyBool_FromLong(r->flag));
    case OC_VAL_SDPA:
        return Py_BuildValue("{s:N,s:N,s:N}", "flash", PyBool_FromLong(r->sdpa[0]), "mem_efficient",
                             PyBool_FromLong(r->sdpa[1]), "math", PyBool_FromLong(r->sdpa[2]));
    case OC_VAL_TEXT:
        return PyUnicode_DecodeUTF8(r->text, (Py_ssize_t)strlen(r->text), "replace");
    case OC_VAL_FRACTION:
        if (r->fraction < 0.0) /* auto: sized when CUDA starts */
            return Py_BuildValue("{s:O,s:O}", "fraction", Py_None, "device", Py_None);
        if (r->device < 0)
            return Py_BuildValue("{s:d,s:O}", "fraction", r->fraction, "device", Py_None);
        return Py_BuildValue("{s:d,s:l}", "fraction", r->fraction, "device", r->device);
    case OC_VAL_OOM:
        return Py_BuildValue(
            "{s:z,s:s,s:z,s:z}", "hooks", r->oom.hooks, "observer", r->oom.observer, "snapshot",
            r->oom.snapshot[0] ? r->oom.snapshot : NULL, "ipython", oc_oom_ipython());
    case OC_VAL_NONE:
        break;
    }
    Py_RETURN_NONE;
}

/* csv's comma-separated words as a list (new ref; [] for ""). */
static PyObject *word_list(const char *csv)
{
    PyObject *text = PyUnicode_FromString(csv), *sep = PyUnicode_FromString(",");
    PyObject *list = !text || !sep ? NULL : csv[0] ? PyUnicode_Split(text, sep, -1) : PyList_New(0);
    Py_XDECREF(text);
    Py_XDECREF(sep);
    return list;
}

/* An optimisation's record as status() gives it (new ref): applied, state,
 * code, value, reason, off_by, notes and the typed values they name (None
 * where unset); "queued" True while it waits for CUDA's start (or was
 * interrupted there) and "interrupted" True when its step was interrupted. */
static PyObject *record_entry(oc_opt opt)
{
    const oc_record *r = oc_record_get(opt);
    char reason[OC_REASON_LEN + 300], notes[400] = "", cc[16];
    const char *text = reason;
    oc_rec_code code = r->code;
    oc_rec_state state = r->state;
    int chose = opt == OC_OPT_FRACTION && code == OC_CODE_PROGRAM_CHOSE, rc = 0;
    PyObject *e, *value, *said, *chosen = chose ? PyFloat_FromDouble(r->fraction) : NULL;
    if (r->state == OC_REC_PENDING)
        text = pending_reason(&code);
    else
        oc_record_reason(opt, reason, sizeof reason);
    /* Turned off by OUTOFCUDA_DISABLE: skipped, not waiting for torch. */
    if (code == OC_CODE_OFF)
        state = OC_REC_SKIPPED;
    for (int i = 0; i < OC_REC_NOTE_COUNT; i++) {
        size_t n = strlen(notes);
        if (r->notes >> i & 1u)
            snprintf(notes + n, sizeof notes - n, ",%s", oc_rec_note_name((oc_rec_note)i));
    }
    snprintf(cc, sizeof cc, "%d.%d", r->cc / 10, r->cc % 10);
    value = record_value(r);
    said = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
    e = value && said && (chosen || !chose)
            ? Py_BuildValue(
                  "{s:O,s:s,s:s,s:O,s:O,s:z,s:N,s:N,s:z,s:O,s:z,s:z}", "applied",
                  r->state == OC_REC_APPLIED ? Py_True : Py_False, "state",
                  oc_rec_state_name(state), "code", oc_rec_code_name(code), "value", value,
                  "reason", said, "off_by",
                  code == OC_CODE_OFF && !r->off_by ? OC_VAR("OUTOFCUDA_DISABLE") : r->off_by,
                  "notes", word_list(notes[0] ? notes + 1 : ""), "left_out", word_list(r->left_out),
                  "variable", r->variable, "chosen", chosen ? chosen : Py_None, "known_bug",
                  r->known_bug, "capability", r->cc > 0 ? cc : NULL)
            : NULL;
    Py_XDECREF(chosen);
    Py_XDECREF(value);
    Py_XDECREF(said);
    if (e != NULL && (r->state == OC_REC_QUEUED || r->state == OC_REC_INTERRUPTED))
        rc = PyDict_SetItemString(e, "queued", Py_True);
    if (e != NULL && rc == 0 && r->state == OC_REC_INTERRUPTED)
        rc = PyDict_SetItemString(e, "interrupted", Py_True);
    if (e != NULL && rc == 0 && oc_cost_get(r->cost) != NULL) {
        const oc_cost *c = oc_cost_get(r->cost);
        PyObject *cost = Py_BuildValue("{s:s,s:[ss]}", "id", c->id, "ways_back", c->ways_back[0],
                                       c->ways_back[1]);
        rc = cost ? PyDict_SetItemString(e, "cost", cost) : -1;
        Py_XDECREF(cost);
    }
    if (rc < 0)
        Py_CLEAR(e);
    return e;
}

/* ---- what is in effect now ----
 *
 * status() reads torch's flags at the moment it is called, through getters
 * that cannot raise (the legacy precision getters raise after a program
 * mixed torch's two precision APIs, and warn on 2.9.0, so matmul TF32 is
 * read through the new API where it exists). */

/* A bool getter's answer as Py_True/Py_False (new ref), or NULL. */
static PyObject *c_bool(PyObject *c_mod, const char *fn)
{
    PyObject *r = oc_call_quiet(c_mod, fn, NULL, NULL);
    int t = r ? PyObject_IsTrue(r) : -1;
    Py_XDECREF(r);
    OC_CLEAR();
    return t < 0 ? NULL : PyBool_FromLong(t);
}

int oc_matmul_tf32(PyObject *c_mod)
{
    PyObject *r = oc_call_quiet(c_mod, "_get_fp32_precision_getter", "cuda", "matmul");
    char v[32];
    int on;
    if (r == NULL) { /* before 2.9: the legacy getter tells */
        r = oc_call_quiet(c_mod, "_get_cublas_allow_tf32", NULL, NULL);
        on = r ? PyObject_IsTrue(r) : -1;
    } else {
        /* "none": nothing chose, so torch's default, full float32. */
        on = PyUnicode_Check(r) ? strcmp(oc_utf8(r, v, sizeof v), "tf32") == 0 : -1;
    }
    Py_XDECREF(r);
    OC_CLEAR();
    return on;
}

/* What opt is now in torch (new ref), or NULL where no getter tells: a
 * plain flag through its row's getter. */
static PyObject *now_value(PyObject *c_mod, oc_opt opt)
{
    const char *getter = oc_opt_row_of(opt)->getter;
    PyObject *r, *flash, *mem, *math;
    int on;
    switch (opt) {
    case OC_OPT_TF32:
        on = oc_matmul_tf32(c_mod);
        r = on >= 0 ? Py_BuildValue("{s:N}", "matmul", PyBool_FromLong(on)) : NULL;
        OC_CLEAR();
        return r;
    case OC_OPT_SDPA:
        flash = c_bool(c_mod, "_get_flash_sdp_enabled");
        mem = c_bool(c_mod, "_get_mem_efficient_sdp_enabled");
        math = c_bool(c_mod, "_get_math_sdp_enabled");
        r = flash && mem && math
                ? Py_BuildValue("{s:O,s:O,s:O}", "flash", flash, "mem_efficient", mem, "math", math)
                : NULL;
        Py_XDECREF(flash);
        Py_XDECREF(mem);
        Py_XDECREF(math);
        OC_CLEAR();
        return r;
    case OC_OPT_ALLOCATOR:
        r = oc_call_quiet(c_mod, "_accelerator_getAllocatorSettings", NULL, NULL);
        if (r != NULL && !PyUnicode_Check(r))
            Py_CLEAR(r);
        return r;
    default:
        return getter ? c_bool(c_mod, getter) : NULL;
    }
}

/* 1 when what outofcuda set (`set`, a value or a dict of them) differs
 * from `now` in any of set's keys; 0 when not; -1 when they cannot be
 * compared. */
static int differs(PyObject *set, PyObject *now)
{
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    if (set == NULL || set == Py_None || now == NULL)
        return -1;
    if (!PyDict_Check(set)) {
        int eq = PyObject_RichCompareBool(set, now, Py_EQ);
        OC_CLEAR();
        return eq < 0 ? -1 : !eq;
    }
    if (!PyDict_Check(now))
        return -1;
    while (PyDict_Next(set, &pos, &k, &v)) {
        PyObject *n = PyDict_GetItem(now, k); /* borrowed */
        int eq;
        if (n == NULL)
            continue;
        eq = PyObject_RichCompareBool(v, n, Py_EQ);
        OC_CLEAR();
        if (eq == 0)
            return 1;
    }
    return 0;
}

/* Adds "now" and "changed" to a copy of an optimisation's record, and says
 * in its reason when the program changed what outofcuda set. */
static int add_now(PyObject *e, oc_opt opt, PyObject *c_mod)
{
    PyObject *now = c_mod ? now_value(c_mod, opt) : NULL;
    PyObject *applied = PyDict_GetItemString(e, "applied"); /* borrowed */
    int changed = applied == Py_True ? differs(PyDict_GetItemString(e, "value"), now) : -1;
    int rc = PyDict_SetItemString(e, "now", now ? now : Py_None);
    if (rc == 0)
        rc = PyDict_SetItemString(e, "changed",
                                  changed < 0 ? Py_None
                                  : changed   ? Py_True
                                              : Py_False);
    if (rc == 0 && changed == 1) {
        PyObject *reason = PyDict_GetItemString(e, "reason"); /* borrowed */
        PyObject *shown = PyObject_Str(now);
        PyObject *text =
            reason && shown
                ? PyUnicode_FromFormat("%U; changed by the program since: now %U", reason, shown)
                : NULL;
        rc = text ? PyDict_SetItemString(e, "reason", text) : -1;
        Py_XDECREF(text);
        Py_XDECREF(shown);
    }
    Py_XDECREF(now);
    return rc;
}

static PyObject *optimizations(void)
{
    PyObject *d = PyDict_New();
    PyObject *torch = torch_imported() ? oc_sys_module("torch") : NULL;
    PyObject *c_mod = torch ? PyObject_GetAttrString(torch, "_C") : NULL;
    OC_CLEAR();
    Py_XDECREF(torch);
    if (d == NULL) {
        Py_XDECREF(c_mod);
        return NULL;
    }
    for (int i = 0; i < OC_OPT_COUNT; i++) {
        const char *name = oc_opt_name((oc_opt)i);
        PyObject *e = record_entry((oc_opt)i);
        if (e == NULL || add_now(e, (oc_opt)i, c_mod) < 0 || PyDict_SetItemString(d, name, e) < 0) {
            Py_XDECREF(e);
            Py_XDECREF(c_mod);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(e);
    }
    Py_XDECREF(c_mod);
    return d;
}

/* status()'s "framework": the framework outofcuda left GPU memory to (or
 * None) and the evidence that it owns it, the one in use now (or None: one
 * in use now, with at_cuda_init "none", came after CUDA started and found
 * outofcuda's settings in effect), and the codes bridge.c decided at torch's
 * import and when CUDA started (None until then), "code" the later. */
static PyObject *framework_status(void)
{
    static const char *const codes[] = {NULL, "none", "left_to", "override", "gone_at_cuda_init"};
    const oc_framework_choice *c = oc_framework_choice_get();
    return Py_BuildValue("{s:z,s:z,s:z,s:z,s:z,s:z}", "left_to", c->left_to[0] ? c->left_to : NULL,
                         "in_use_now", oc_framework_in_use(NULL, 0), "at_import", codes[c->at[0]],
                         "at_cuda_init", codes[c->at[1]], "code", codes[c->at[c->at[1] != 0]],
                         "evidence", oc_framework_evidence(c->left_to));
}

/* status()'s "cuda_init": each step of the CUDA-init callback (bridge.c) by
 * name, with where it stands (oc_step_state's word). */
static PyObject *cuda_init_status(void)
{
#define OC_STEP_NAME(id, name) name,
    static const char *const names[] = {OC_CUDA_STEPS(OC_STEP_NAME)};
    static const char *const states[] = {OC_STEP_STATES(OC_STEP_NAME)};
#undef OC_STEP_NAME
    PyObject *d = PyDict_New(), *v;
    for (int i = 0; d != NULL && i < OC_STEP_COUNT; i++) {
        v = PyUnicode_FromString(states[oc_cuda_step_state((oc_cuda_step)i)]);
        if (v == NULL || PyDict_SetItemString(d, names[i], v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

/* Turned off by OUTOFCUDA_DISABLE where the hook ran: installed, not missing.
 * The boot refused to install, or (OUTOFCUDA_DISABLE=1) the hook file's line
 * stopped before loading it: site ran (no -S) and a hook file lies beside
 * the engine (module). */
static int installed_and_off(PyObject *module)
{
    PyObject *flags = PySys_GetObject("flags"); /* borrowed */
    PyObject *no_site = flags ? PyObject_GetAttrString(flags, "no_site") : NULL;
    PyObject *path =
        no_site && !PyObject_IsTrue(no_site) ? PyModule_GetFilenameObject(module) : NULL;
    PyObject *bytes = path ? PyUnicode_EncodeFSDefault(path) : NULL;
    const char *p = bytes ? PyBytes_AsString(bytes) : NULL, *slash = p ? strrchr(p, '/') : NULL;
    char file[PATH_MAX];
    struct stat st;
    int found = PyDict_GetItemString(PyImport_GetModuleDict(), OC_BOOT_NAME) != NULL;
    for (int i = 0; !found && slash != NULL && i < 2; i++) {
        snprintf(file, sizeof file, "%.*s/" OC_BOOT_NAME "%s", (int)(slash - p), p,
                 i ? ".start" : ".pth");
        found = stat(file, &st) == 0;
    }
    OC_CLEAR(); /* unreadable: not found */
    Py_XDECREF(bytes);
    Py_XDECREF(path);
    Py_XDECREF(no_site);
    return found && oc_disabled_by_env();
}

static PyObject *py_status(PyObject *self, PyObject *unused)
{
    const oc_config *cfg = oc_config_if_loaded();
    PyObject *opts, *warnings, *bugs, *framework, *cuda_init, *error = oc_error();
    int installed = hook.installed || (self != NULL && installed_and_off(self));
    (void)unused;
    opts = optimizations();
    warnings = opts ? PyList_New(0) : NULL;
    for (int i = 0; warnings != NULL && cfg != NULL && i < cfg->n_warnings; i++) {
        PyObject *s =
            PyUnicode_DecodeUTF8(cfg->warnings[i], (Py_ssize_t)strlen(cfg->warnings[i]), "replace");
        if (s == NULL || PyList_Append(warnings, s) < 0)
            Py_CLEAR(warnings);
        Py_XDECREF(s);
    }
    bugs = warnings ? oc_known_bugs_status() : NULL;
    framework = bugs ? framework_status() : NULL;
    cuda_init = framework ? cuda_init_status() : NULL;
    if (cuda_init == NULL) {
        Py_XDECREF(opts);
        Py_XDECREF(warnings);
        Py_XDECREF(bugs);
        Py_XDECREF(framework);
        return NULL;
    }
    return Py_BuildValue("{s:s,s:{s:O,s:O,s:O},s:O,s:N,s:N,s:N,s:N,s:N}", "version", OC_VERSION,
                         "hook", "installed", installed ? Py_True : Py_False, "fired",
                         hook.fired ? Py_True : Py_False, "error", error ? error : Py_None, "torch",
                         hook.torch_version ? hook.torch_version : Py_None, "optimizations", opts,
                         "config_warnings", warnings, "known_bugs", bugs, "framework", framework,
                         "cuda_init", cuda_init);
}

/* The verbose table fits 80 columns: name and applied, then the value from
 * column 32 (a dict one key=value a line when the items do not fit on one),
 * then the reason on lines of its own, indented by 6. Nothing is cut off. */
#define TABLE_WIDTH 80
#define VALUE_COL 32
#define REASON_INDENT 6

/* Text of any value for the table: "-" for None, else str(). */
static void value_text(PyObject *v, char *buf, size_t sz)
{
    PyObject *s;
    if (v == NULL || v == Py_None) {
        snprintf(buf, sz, "-");
        return;
    }
    s = PyObject_Str(v);
    if (s == NULL) {
        OC_CLEAR();
        snprintf(buf, sz, "?");
        return;
    }
    oc_utf8(s, buf, sz);
    Py_DECREF(s);
}

/* The byte after the UTF-8 character at text[at]. */
static size_t next_char(const char *text, size_t len, size_t at)
{
    do
        at++;
    while (at < len && ((unsigned char)text[at] & 0xc0) == 0x80);
    return at;
}

/* Where the first line of text (len bytes of UTF-8) ends for a line of
 * `width` characters whose continuation lines start at column `indent`: the
 * bytes it keeps (len when all fits), and in *skip the blanks the break eats.
 * A line breaks only at blanks, never inside a word, so a path or an
 * allocator string can be copied whole. A word longer than the line stands
 * whole on its line, past the width; it stays on the first line when it
 * starts there at or before `indent` (after a label: a continuation line
 * would give it no more room). */
static size_t wrap_cut(const char *text, size_t len, size_t width, size_t indent, size_t *skip)
{
    size_t lead = width < TABLE_WIDTH ? TABLE_WIDTH - width : 0; /* the line's first column */
    size_t at = 0, chars = 0, kept = 0;
    int first = 1;
    *skip = 0;
    while (at < len && text[at] == ' ')
        at = next_char(text, len, at), chars++;
    while (at < len) {
        size_t word_col = chars;
        while (at < len && text[at] != ' ')
            at = next_char(text, len, at), chars++;
        if (!first && chars > width && lead + word_col > indent)
            break; /* before this word */
        first = 0;
        kept = at;
        if (chars > width)
            break; /* a word longer than the line, kept whole: break after it */
        while (at < len && text[at] == ' ')
            at = next_char(text, len, at), chars++;
        if (chars > width)
            break;
    }
    /* Only blanks after what the line keeps: all of it is one line. */
    for (at = kept; at < len && text[at] == ' '; at++)
        ;
    if (at >= len)
        return len;
    *skip = at - kept;
    return kept;
}

/* The status table's text: pieces appended to a list of str (a piece that
 * cannot be made is left out: the table is for people). */
static void put(PyObject *out, const char *fmt, ...)
{
    char buf[1200];
    va_list ap;
    PyObject *s;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    s = PyUnicode_DecodeUTF8(buf, (Py_ssize_t)strlen(buf), "replace");
    if (s == NULL || PyList_Append(out, s) < 0)
        OC_CLEAR();
    Py_XDECREF(s);
}

/* Writes text in lines of at most `first` characters (the first line, after
 * what the caller wrote) and TABLE_WIDTH - indent characters (the others,
 * indented), broken as wrap_cut says. */
static void write_wrapped(PyObject *out, const char *text, size_t first, size_t indent)
{
    size_t width = first, len = strlen(text);
    for (;;) {
        size_t skip, cut = wrap_cut(text, len, width, indent, &skip);
        if (cut == len) {
            put(out, "%s\n", text);
            return;
        }
        put(out, "%.*s\n%*s", (int)cut, text, (int)indent, "");
        text += cut + skip;
        len -= cut + skip;
        width = TABLE_WIDTH - indent;
    }
}

/* Writes an optimisation's value from column VALUE_COL on. */
static void write_value(PyObject *out, PyObject *v)
{
    char joined[1000], item[520], text[400];
    Py_ssize_t pos = 0;
    PyObject *key, *val;
    size_t used = 0;
    if (v == NULL || !PyDict_Check(v) || PyDict_Size(v) == 0) {
        value_text(v, text, sizeof text);
        write_wrapped(out, text, TABLE_WIDTH - VALUE_COL, VALUE_COL);
        return;
    }
    joined[0] = '\0';
    while (PyDict_Next(v, &pos, &key, &val)) {
        char k[100];
        value_text(key, k, sizeof k);
        value_text(val, text, sizeof text);
        used += (size_t)snprintf(joined + used, used < sizeof joined ? sizeof joined - used : 0,
                                 "%s%s=%s", used ? ", " : "", k, text);
        if (used >= sizeof joined)
            break;
    }
    if (used <= TABLE_WIDTH - VALUE_COL) {
        put(out, "%s\n", joined);
        return;
    }
    /* One item a line, continuation lines two further in. */
    pos = 0;
    for (int i = 0; PyDict_Next(v, &pos, &key, &val); i++) {
        char k[100];
        value_text(key, k, sizeof k);
        value_text(val, text, sizeof text);
        snprintf(item, sizeof item, "%s=%s", k, text);
        if (i > 0)
            put(out, "%*s", VALUE_COL, "");
        write_wrapped(out, item, TABLE_WIDTH - VALUE_COL, VALUE_COL + 2);
    }
}

/* d[key] as text ("-" when d is no dict or has no such key). */
static void key_text(PyObject *d, const char *key, char *buf, size_t sz)
{
    value_text(d && PyDict_Check(d) ? PyDict_GetItemString(d, key) : NULL, buf, sz);
}

/* The "applied" word of the table, from a row's state and code: queued
 * (waiting for CUDA's start, or its step was interrupted there), yes, off (a
 * switch turned it off; off_by names it), no. */
static const char *applied_word(const char *state, const char *code)
{
    if (strcmp(state, "queued") == 0 || strcmp(state, "interrupted") == 0)
        return "queued";
    if (strcmp(state, "applied") == 0)
        return "yes";
    return strcmp(code, "off") == 0 ? "off" : "no";
}

/* The optimisations: name, applied word, value, and the reason below; one
 * reason for all where every row has the same code and off_by. */
static void write_optimisations(PyObject *out, PyObject *opts)
{
    char name[64], state[32], code[100], first[100] = "", reason[OC_REASON_LEN + 300];
    Py_ssize_t pos = 0;
    PyObject *k, *e;
    int shared = PyDict_Size(opts) > 1;
    while (PyDict_Next(opts, &pos, &k, &e)) {
        key_text(e, "code", code, 50);
        key_text(e, "off_by", code + strlen(code), 50);
        shared &= !first[0] || strcmp(first, code) == 0;
        snprintf(first, sizeof first, "%s", code);
    }
    put(out, "  %-20s %-8s value%s\n", "optimisation", "applied", shared ? "" : " (reason below)");
    for (pos = 0; PyDict_Next(opts, &pos, &k, &e);) {
        value_text(k, name, sizeof name);
        key_text(e, "state", state, sizeof state);
        key_text(e, "code", code, sizeof code);
        put(out, "  %-20s %-8s ", name, applied_word(state, code));
        write_value(out, PyDict_Check(e) ? PyDict_GetItemString(e, "value") : NULL);
        snprintf(reason, 9, "  (all: ");
        key_text(e, "reason", reason + 8, sizeof reason - 9);
        put(out, "%*s", shared ? 0 : REASON_INDENT, "");
        if (!shared)
            write_wrapped(out, reason + 8, TABLE_WIDTH - REASON_INDENT, REASON_INDENT);
    }
    if (shared)
        write_wrapped(out, strcat(reason, ")"), TABLE_WIDTH, REASON_INDENT);
}

/* The known-bugs row: applied "yes" when a guard acted, "queued" while one
 * waits for CUDA's start, "off" when every row is; the value counts the rows
 * not affected here, and a line below gives each other row (one line for
 * all when all are off). */
static void write_known_bugs(PyObject *out, PyObject *bugs, PyObject *cuda_init)
{
    char verdict[32], code[32], id[100], why[600], line[800], step[32];
    int unaffected = 0, off = 0, avoided = 0;
    Py_ssize_t n = bugs && PyList_Check(bugs) ? PyList_Size(bugs) : 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        key_text(PyList_GetItem(bugs, i), "verdict", verdict, sizeof verdict);
        key_text(PyList_GetItem(bugs, i), "code", code, sizeof code);
        unaffected += strcmp(verdict, "not_affected") == 0;
        off += strcmp(code, "off") == 0;
        avoided |= strcmp(code, "avoided") == 0;
    }
    key_text(cuda_init, "known_bugs", step, sizeof step);
    if (n > 0)
        put(out, "  %-20s %-8s %d of %d not affected\n", "known_bugs",
            avoided                                         ? "yes"
            : strcmp(applied_word(step, ""), "queued") == 0 ? "queued"
            : off == n                                      ? "off"
                                                            : "no",
            unaffected, (int)n);
    for (Py_ssize_t i = 0; i < n && !(off == n && i > 0); i++) {
        PyObject *e = PyList_GetItem(bugs, i);
        key_text(e, "id", id, sizeof id);
        key_text(e, "verdict", verdict, sizeof verdict);
        key_text(e, "code", code, sizeof code);
        key_text(e, "reason", why, sizeof why);
        snprintf(line, sizeof line, "%s: %s, %s: %s", id, verdict, code, why);
        put(out, "%*s", strcmp(verdict, "not_affected") ? REASON_INDENT : 0, "");
        if (strcmp(verdict, "not_affected") != 0)
            write_wrapped(out, off == n ? why : line, TABLE_WIDTH - REASON_INDENT, REASON_INDENT);
    }
}

/* The status table of a status() dict (or of the command line's, which has
 * the same keys): the optimisations, the known bugs and the error, as the
 * verbose table, `outofcuda status` and `outofcuda report --bug` print it.
 * A new str, or NULL with an exception. */
static PyObject *status_text(PyObject *st)
{
    PyObject *out = PyList_New(0), *opts = PyDict_GetItemString(st, "optimizations"), *empty, *text;
    char error[400];
    if (out == NULL)
        return NULL;
    if (opts != NULL && PyDict_Check(opts))
        write_optimisations(out, opts);
    write_known_bugs(out, PyDict_GetItemString(st, "known_bugs"),
                     PyDict_GetItemString(st, "cuda_init"));
    key_text(PyDict_GetItemString(st, "hook"), "error", error, sizeof error);
    if (strcmp(error, "-") != 0) {
        put(out, "  error: ");
        write_wrapped(out, error, TABLE_WIDTH - 9, 9);
    }
    empty = PyUnicode_FromString("");
    text = empty ? PyUnicode_Join(empty, out) : NULL;
    Py_XDECREF(empty);
    Py_DECREF(out);
    return text;
}

void oc_report_verbose(void)
{
    char tv[64], table[16384];
    PyObject *st, *text;
    /* torchrun's launcher imports torch but runs no model: its table would
     * read as one more rank's. Each worker prints its own, labelled. */
    if (oc_torchrun_launcher())
        return;
    value_text(hook.torch_version, tv, sizeof tv);
    oc_stderr_printf("outofcuda %s: torch %s imported\n", OC_VERSION, tv);
    st = py_status(NULL, NULL);
    text = st ? status_text(st) : NULL;
    if (text != NULL)
        oc_stderr_write(oc_utf8(text, table, sizeof table));
    OC_CLEAR();
    Py_XDECREF(text);
    Py_XDECREF(st);
}

/* _status_text(status) -> str: the status table of a status() dict. */
static PyObject *py_status_text(PyObject *self, PyObject *st)
{
    (void)self;
    if (PyDict_Check(st))
        return status_text(st);
    PyErr_SetString(PyExc_TypeError, "_status_text: a status() dict is needed");
    return NULL;
}

/* _wrap(text, first, indent) -> list of str: text in lines as the status
 * table breaks its values (wrap_cut), continuation lines indented, so that the
 * CLI's other text breaks by the same rule. */
static PyObject *py_wrap(PyObject *self, PyObject *args)
{
    const char *text;
    char blanks[TABLE_WIDTH];
    Py_ssize_t len, first, indent;
    size_t width, skip, cut;
    PyObject *lines, *line, *pad = NULL, *padded;
    (void)self;
    if (!PyArg_ParseTuple(args, "s#nn:_wrap", &text, &len, &first, &indent))
        return NULL;
    if (first < 1 || indent < 0 || indent >= TABLE_WIDTH)
        return PyErr_Format(PyExc_ValueError, "_wrap: first >= 1, 0 <= indent < %d", TABLE_WIDTH);
    memset(blanks, ' ', sizeof blanks);
    lines = PyList_New(0);
    for (width = (size_t)first; lines != NULL; width = TABLE_WIDTH - (size_t)indent) {
        cut = wrap_cut(text, (size_t)len, width, (size_t)indent, &skip);
        line = PyUnicode_DecodeUTF8(text, (Py_ssize_t)cut, "replace");
        if (line != NULL && pad != NULL) {
            padded = PyUnicode_Concat(pad, line);
            Py_DECREF(line);
            line = padded;
        }
        if (line == NULL || PyList_Append(lines, line) < 0)
            Py_CLEAR(lines);
        Py_XDECREF(line);
        if (lines == NULL || cut == (size_t)len)
            break;
        text += cut + skip;
        len -= (Py_ssize_t)(cut + skip);
        if (pad == NULL && (pad = PyUnicode_DecodeUTF8(blanks, indent, NULL)) == NULL)
            Py_CLEAR(lines);
    }
    Py_XDECREF(pad);
    return lines;
}

/* _labelled(text) -> str: text with the rank label (oc_rank_label) before
 * each of its lines, for what the Python layer prints. */
static PyObject *py_labelled(PyObject *self, PyObject *args)
{
    PyObject *str, *bytes, *res;
    int at_start = 1;
    char *out;
    (void)self;
    if (!PyArg_ParseTuple(args, "U", &str))
        return NULL;
    bytes = PyUnicode_AsEncodedString(str, "utf-8", "surrogatepass");
    if (bytes == NULL)
        return NULL;
    /* A NUL would end the C string early: such text goes as it is. */
    out = strlen(PyBytes_AsString(bytes)) == (size_t)PyBytes_Size(bytes)
              ? oc_labelled(PyBytes_AsString(bytes), &at_start)
              : NULL;
    res = out ? PyUnicode_DecodeUTF8(out, (Py_ssize_t)strlen(out), "surrogatepass")
              : (Py_INCREF(str), str);
    free(out);
    Py_DECREF(bytes);
    return res;
}

OC_EDGE_VARARGS(py_labelled)
OC_EDGE_NOARGS(py_status)
OC_EDGE_O(py_status_text)
OC_EDGE_VARARGS(py_wrap)

PyMethodDef oc_report_methods[] = {
    OC_METHOD(
        "_labelled", py_labelled,
        "_labelled(text, /)\n--\n\nThe text with the rank label ([rank N] under torchrun) before "
        "each line."),
    OC_METHOD("_status_text", py_status_text,
              "_status_text(status, /)\n--\n\nThe status table of a status() dict, as text."),
    OC_METHOD("_wrap", py_wrap,
              "_wrap(text, first, indent, /)\n--\n\nThe text in lines of at most `first` "
              "characters, then 80 - indent after indent blanks, broken as the status table is."),
    OC_METHOD("status", py_status,
              "status()\n--\n\nWhat outofcuda did in this process, as a JSON-serialisable dict."),
    {NULL, NULL, 0, NULL},
};
