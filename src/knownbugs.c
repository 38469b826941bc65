/* knownbugs.c - the known-bugs table (kbtable.c) applied to the running
 * torch: what can be decided at import is decided then, the rest (cuDNN's
 * version where no wheel names it, a read that loads libcudnn_graph: 51 MiB
 * of RSS and 6 ms measured on torch 2.14.1's CUDA build) when CUDA starts, from the one
 * lazy-init callback; a row that needs this process's contexts is decided
 * from NVML whenever status() or the exit summary asks. */
#include "oc.h"

#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- applying the table to the running torch ---- */

/* What was decided of each row (process-wide, under the GIL: see oc.h). */
typedef struct {
    int decided;                         /* the import-time step ran */
    oc_kb_code code[OC_KB_MAX_ENTRIES];  /* its verdict follows (oc_kb_verdict) */
    char reason[OC_KB_MAX_ENTRIES][400]; /* the facts, in words */
    long cudnn;                          /* -1 until read */
    long nccl;                           /* -1 until read */
    int other_cudnn;                     /* read once, at import */
    int need_cudnn;                      /* a steer, on or off, waits for cuDNN's version */
    int redecide;                        /* an attention guard acts or waits: decide again */
} kb_rows;
static kb_rows kb;

static const char *proc_getenv(const char *name, void *ctx)
{
    (void)ctx;
    return oc_env(name);
}

/* "12.1" -> 1201; 0 when it cannot be read. */
static long cuda_number(const char *v)
{
    long major = 0, minor = 0;
    if (v == NULL || sscanf(v, "%ld.%ld", &major, &minor) < 1 || major <= 0 || major > 99 ||
        minor < 0 || minor > 99)
        return 0;
    return major * 100 + minor;
}

/* Fills the facts nothing has read yet: unknown, no device, no process list. */
static void facts_init(oc_kb_facts *f)
{
    memset(f, 0, sizeof *f);
    f->n_cc = -1;
    f->cudnn = f->nccl = f->other_cudnn = -1;
    f->local_rank = -1;
    f->foreign_dev = -2;
#ifdef __aarch64__
    f->aarch64 = 1;
#endif
}

/* The version of the distribution beside torch (name + CUDA's major, as
 * nvidia_cudnn_cu13) from its .dist-info folder's name, numbered as torch
 * numbers cuDNN (below 9: major*1000) and NCCL: major*10000+minor*100+patch;
 * -1 when none is there. Lists one folder, loads no library. */
static long dist_version(PyObject *torch, const char *name, long cuda)
{
    char dir[2048], pattern[2200], *slash;
    PyObject *file = torch ? PyObject_GetAttrString(torch, "__file__") : NULL;
    const char *path = file && PyUnicode_Check(file) ? oc_utf8(file, dir, sizeof dir) : NULL;
    glob_t g;
    long a = 0, b = 0, c = 0, v = -1;
    Py_XDECREF(file);
    OC_CLEAR();
    for (int up = 0; path == dir && up < 2 && (slash = strrchr(dir, '/')) != NULL; up++)
        *slash = '\0';
    if (path != dir || cuda <= 0)
        return -1;
    snprintf(pattern, sizeof pattern, "%s/%s%ld-*.dist-info", dir, name, cuda / 100);
    if (glob(pattern, 0, NULL, &g) == 0) {
        if (sscanf(strchr(strrchr(g.gl_pathv[0], '/'), '-'), "-%ld.%ld.%ld", &a, &b, &c) >= 2)
            v = a * (a < 9 && name[7] == 'c' ? 1000 : 10000) + b * 100 + c;
        globfree(&g);
    }
    return v;
}

/* 1 when a libcudnn.so.9 lies in a folder of ld_path or of the system's
 * usual ones other than a cuDNN wheel's (.../nvidia/cudnn/lib), else 0. */
static int other_cudnn(const char *ld_path)
{
    char list[2048], path[2100], *save = NULL;
    snprintf(
        list, sizeof list,
        "%s:/usr/lib/x86_64-linux-gnu:/usr/lib/aarch64-linux-gnu:/usr/lib64:/usr/local/cuda/lib64",
        ld_path ? ld_path : "");
    for (char *d = strtok_r(list, ":", &save); d != NULL; d = strtok_r(NULL, ":", &save)) {
        snprintf(path, sizeof path, "%s/libcudnn.so.9", d);
        if (strstr(d, "nvidia/cudnn") == NULL && access(path, F_OK) == 0)
            return 1;
    }
    return 0;
}

/* torch's version and build, read from the module (never imports). */
static void torch_facts(PyObject *torch, oc_kb_facts *f)
{
    PyObject *cuda;
    f->torch = oc_torch_version(torch);
    cuda = oc_getattr_chain(torch, "version.cuda");
    f->cuda_build = cuda == NULL ? -1 : cuda != Py_None;
    if (cuda != NULL && PyUnicode_Check(cuda)) {
        char buf[32];
        f->cuda = cuda_number(oc_utf8(cuda, buf, sizeof buf));
    }
    Py_XDECREF(cuda);
    OC_CLEAR();
    f->local_rank = oc_env_rank("LOCAL_RANK");
}

/* A device NVML lists this process on that is not LOCAL_RANK's (what
 * oc_kb_foreign_device says), or -2 when NVML cannot tell. No CUDA call. */
static int live_foreign_device(long local_rank)
{
    int map[OC_NVML_MAX_DEVICES], ctx[OC_NVML_MAX_DEVICES], n, nctx = 0;
    unsigned int self = (unsigned int)getpid();
    if (local_rank <= 0)
        return -1;
    if (!oc_nvml_available(NULL, 0) || (n = oc_nvml_visible_map(map, OC_NVML_MAX_DEVICES)) < 0)
        return -2;
    for (int i = 0; i < n; i++) {
        oc_gpu_proc *procs = NULL;
        int k = oc_nvml_process_list(map[i], &procs);
        for (int j = 0; j < k; j++) {
            if (procs[j].pid == self) {
                ctx[nctx++] = i;
                break;
            }
        }
        free(procs);
        if (k < 0)
            return -2;
    }
    return oc_kb_foreign_device(local_rank, n, ctx, nctx);
}

/* 1 when OUTOFCUDA_KNOWN_BUGS turns row i off (all of them with 0). */
static int row_off(size_t i)
{
    const oc_config *cfg = oc_config_get();
    return !cfg->known_bugs ||
           (i < 8 * sizeof cfg->known_bugs_off && (cfg->known_bugs_off >> i) & 1);
}

int oc_known_bug_on(const char *id)
{
    int i = oc_known_bug_index(id, 0);
    return i >= 0 && !row_off((size_t)i);
}

/* Compute capabilities of the devices CUDA shows this process, from NVML
 * (no CUDA context). n_cc stays -1 when NVML cannot tell. */
static void device_facts(oc_kb_facts *f)
{
    int map[OC_NVML_MAX_DEVICES], n;
    char why[200];
    f->n_cc = -1;
    if (!oc_nvml_available(why, sizeof why))
        return;
    n = oc_nvml_visible_map(map, OC_NVML_MAX_DEVICES);
    if (n < 0)
        return;
    f->n_cc = 0;
    for (int i = 0; i < n && f->n_cc < OC_KB_MAX_DEVICES; i++) {
        oc_gpu_info info;
        if (oc_nvml_device_info(map[i], &info) != 0 || info.cc_major <= 0) {
            f->n_cc = -1; /* one device unknown: the set is unknown */
            return;
        }
        f->cc[f->n_cc++] = info.cc_major * 10 + info.cc_minor;
    }
}

/* Decides every entry still undecided, from the torch facts first: NVML is
 * asked about the devices only when some entry still needs them, so that a
 * CPU-only build, or a torch outside every entry's releases, never loads
 * the driver's library at `import torch`. A row turned off is decided too,
 * for the facts alone (its verdict is not kept): which facts are read never
 * depends on which rows are on. Returns 1 when a row still waits for cuDNN's
 * version (read when CUDA starts). */
static int decide_all(PyObject *torch, size_t n)
{
    oc_kb_facts f;
    int need_devices = 0, need_cudnn = 0;
    facts_init(&f);
    torch_facts(torch, &f);
    f.cudnn = kb.cudnn;
    f.nccl = kb.nccl;
    f.other_cudnn = kb.other_cudnn;
    f.getenv_fn = proc_getenv;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            if (!need_devices)
                break;
            device_facts(&f);
        }
        need_devices = need_cudnn = 0;
        for (size_t i = 0; i < n; i++) {
            const oc_known_bug *b = oc_known_bug_at(i);
            oc_kb_code c = kb.code[i];
            if (c == OC_KBC_NEEDS_FACT || c == OC_KBC_OFF)
                c = oc_known_bug_decide(b, &f, row_off(i) ? NULL : kb.reason[i],
                                        sizeof kb.reason[i]);
            if (!row_off(i))
                kb.code[i] = c;
            /* A named row still waiting for cuDNN asks NVML when CUDA starts. */
            need_devices |= c == OC_KBC_NEEDS_FACT && !oc_range_any(b->cc) &&
                            (b->action != OC_KB_REPORT || oc_range_any(b->cudnn) || f.cudnn >= 0);
            need_cudnn |=
                c == OC_KBC_NEEDS_FACT && !oc_range_any(b->cudnn) && b->action != OC_KB_REPORT;
        }
    }
    return need_cudnn;
}

/* Row i is still undecided for want of cuDNN's version alone. */
static int waits_for_cudnn(size_t i)
{
    return kb.code[i] == OC_KBC_NEEDS_FACT && !oc_range_any(oc_known_bug_at(i)->cudnn);
}

/* Steers decided at import (the allocator one was taken before torch
 * loaded, the TF32 one is how outofcuda sets TF32): whether they hold. */
static void act_at_import(const oc_known_bug *b, size_t i)
{
    size_t len = strlen(kb.reason[i]);
    char *tail = kb.reason[i] + len;
    size_t room = sizeof kb.reason[i] - len;
    if (b->action == OC_KB_ALLOC_GENERIC) {
        const oc_record *alloc = oc_record_get(OC_OPT_ALLOCATOR);
        int handed = alloc->notes >> OC_NOTE_GENERIC_VARIABLE & 1u;
        kb.code[i] = handed ? OC_KBC_AVOIDED : OC_KBC_NOT_AVOIDED;
        if (handed)
            snprintf(tail, room, "; %s", b->action_text);
        else
            snprintf(tail, room,
                     "; outofcuda's allocator settings did not reach torch (allocator: %s, %s)",
                     oc_rec_state_name(alloc->state), oc_rec_code_name(alloc->code));
    } else if (b->action == OC_KB_TF32_LEGACY) {
        kb.code[i] = OC_KBC_AVOIDED;
        snprintf(tail, room, "; %s", b->action_text);
    }
}

void oc_known_bugs_at_import(PyObject *torch, const char *no_queue)
{
    const oc_config *cfg = oc_config_get();
    size_t n = oc_known_bug_count();
    int need_cudnn, pending; /* a guard waits for cuDNN; something is left for CUDA's start */
    oc_kb_facts f;
    memset(&kb, 0, sizeof kb);
    kb.cudnn = kb.nccl = -1;
    kb.decided = 1;
    for (size_t i = 0; i < n; i++) {
        kb.code[i] = row_off(i) ? OC_KBC_OFF : OC_KBC_NEEDS_FACT;
        if (row_off(i))
            snprintf(kb.reason[i], sizeof kb.reason[i],
                     "off by OUTOFCUDA_KNOWN_BUGS%s: torch's own choice kept, nothing checked",
                     cfg->known_bugs ? " (it names this row)" : "");
    }
    if (!cfg->known_bugs)
        return;
    facts_init(&f);
    torch_facts(torch, &f);
    /* The cuDNN wheel's version needs no library loaded: with it, no row
     * waits for CUDA's start to read the runtime's. */
    kb.cudnn = dist_version(torch, "nvidia_cudnn_cu", f.cuda);
    kb.nccl = dist_version(torch, "nvidia_nccl_cu", f.cuda);
    kb.other_cudnn = other_cudnn(oc_env("LD_LIBRARY_PATH"));
    /* Left for CUDA's start: reading cuDNN's version where no wheel names it
     * (+51 MiB of RSS), only for a steer, and the cuDNN-attention steer. */
    pending = need_cudnn = kb.need_cudnn = kb.redecide = decide_all(torch, n);
    for (size_t i = 0; i < n; i++) {
        size_t len = strlen(kb.reason[i]);
        if (kb.code[i] == OC_KBC_APPLIES)
            act_at_import(oc_known_bug_at(i), i);
        else if (waits_for_cudnn(i) && (!need_cudnn || no_queue != NULL)) /* never, or not here */
            snprintf(kb.reason[i] + len, sizeof kb.reason[i] - len,
                     need_cudnn ? " (never: %s)"
                                : " (only where a guard needs it; `outofcuda doctor` reads it)%s",
                     need_cudnn ? no_queue : "");
        /* A guard decided now (the wheel named cuDNN) acts when CUDA starts. */
        kb.redecide |=
            kb.code[i] == OC_KBC_APPLIES && oc_known_bug_at(i)->action == OC_KB_SDPA_NO_CUDNN;
        pending |= kb.code[i] == OC_KBC_APPLIES && oc_known_bug_at(i)->action != OC_KB_REPORT;
    }
    if (pending && no_queue == NULL)
        oc_cuda_step_arm(OC_STEP_KNOWN_BUGS);
}

/* The runtime cuDNN's version, or 0 when torch has none, -1 when it cannot
 * be read. torch._C._cudnn.getVersionInt() first: it is what
 * torch.backends.cudnn.version() returns, without that function's checks,
 * which ask torch.cuda for every device's capability (with a GPU present,
 * that initialises CUDA: never at import, then). Loads libcudnn_graph. */
static long read_cudnn_version(PyObject *torch)
{
    PyObject *fn = oc_getattr_chain(torch, "_C._cudnn.getVersionInt"), *r;
    long v = -1;
    if (fn == NULL)
        fn = oc_getattr_chain(torch, "backends.cudnn.version");
    if (fn == NULL) {
        OC_CLEAR();
        return -1;
    }
    r = PyObject_CallObject(fn, NULL);
    if (r == Py_None)
        v = 0;
    else if (r != NULL && PyLong_Check(r))
        v = PyLong_AsLong(r);
    Py_XDECREF(r);
    Py_DECREF(fn);
    OC_CLEAR();
    return v;
}

/* ---- the cuDNN-attention guard ----
 *
 * Only torch's flags are read and written: torch's own objects (an open
 * sdpa_kernel() block's saved flags) are never searched. A block open when
 * CUDA starts restores the flags it saved on entry when it exits, cuDNN
 * attention on among them; status() reads the flag when asked, so that it
 * says so (docs/known-bugs.md). */

/* 1 when torch's SDPA getter says on, 0 off, -1 when it cannot be read. */
static int sdp_flag(PyObject *c_mod, const char *getter)
{
    PyObject *r = oc_call_quiet(c_mod, getter, NULL, NULL);
    int on = r ? PyObject_IsTrue(r) : -1;
    Py_XDECREF(r);
    OC_CLEAR();
    return on;
}

/* Known bug expandable-ipc-2.13's steer, when CUDA starts: a DataLoader worker's CUDA tensors
 * leave it only through CUDA IPC, and it allocates little, so expandable segments from
 * outofcuda's defaults (a user's own expandable_segments wins) go off there, before its first
 * allocation. A run a Ctrl-C cut short finds its own record (at_cuda_init): done. */
static oc_kb_code ipc_steer(PyObject *torch, const oc_known_bug *b, char *why, size_t sz)
{
    const oc_record *alloc = oc_record_get(OC_OPT_ALLOCATOR);
    PyObject *m = oc_sys_module("torch.utils.data._utils.worker");
    PyObject *w = m ? PyObject_GetAttrString(m, "_worker_info") : NULL;
    const char *user = NULL, *used;
    char conf[OC_ALLOC_CONF_MAX];
    int worker = w != NULL && w != Py_None, rc;
    int done = worker && alloc->code == OC_CODE_AT_CUDA_INIT; /* only this steer writes it */
    Py_XDECREF(w);
    Py_XDECREF(m);
    OC_CLEAR();
    oc_alloc_user_var(oc_torch_version(torch), &user);
    if (worker && !done && alloc->state == OC_REC_APPLIED && oc_alloc_expandable(alloc->text) &&
        oc_config_get()->alloc_conf_no_expandable[0] &&
        oc_alloc_value(user, "expandable_segments", NULL, 0) == 0 &&
        oc_alloc_merge(alloc->text, "expandable_segments:False", NULL, NULL, conf, sizeof conf,
                       NULL, 0, NULL, 0) == 0) {
        m = PyObject_GetAttrString(torch, "_C");
        rc = m ? oc_alloc_call_setter(m, conf, &used) : 0;
        Py_XDECREF(m);
        OC_CLEAR();
        if (rc != 1)
            return OC_KBC_NOT_AVOIDED; /* the reason stays the row's: applies */
        oc_record_set(OC_OPT_ALLOCATOR, OC_REC_APPLIED, OC_CODE_AT_CUDA_INIT,
                      "given to torch's setter when CUDA started in this DataLoader worker, "
                      "expandable segments off (known bug %s)",
                      b->id);
        oc_record_text(OC_OPT_ALLOCATOR, conf);
        done = 1;
    }
    if (done)
        snprintf(why, sz, "; %s", b->action_text);
    return done ? OC_KBC_AVOIDED : OC_KBC_APPLIES;
}

/* Takes entry i's action: its code (the reason appended to). */
static oc_kb_code act(PyObject *torch, const oc_known_bug *b, size_t i)
{
    static const char *const others[] = {"_get_flash_sdp_enabled", "_get_mem_efficient_sdp_enabled",
                                         "_get_math_sdp_enabled"};
    size_t len = strlen(kb.reason[i]);
    PyObject *c_mod;
    int on, other = 0, rc;
    if (b->action == OC_KB_IPC_NO_EXPANDABLE)
        return ipc_steer(torch, b, kb.reason[i] + len, sizeof kb.reason[i] - len);
    if (b->action != OC_KB_SDPA_NO_CUDNN)
        return OC_KBC_APPLIES;
    c_mod = PyObject_GetAttrString(torch, "_C");
    if (c_mod == NULL) {
        OC_CLEAR();
        return OC_KBC_NOT_AVOIDED;
    }
    /* Unread, cuDNN attention counts as on and another backend as off: a
     * write is then made only where one is sure to be left. */
    on = sdp_flag(c_mod, "_get_cudnn_sdp_enabled") != 0;
    for (size_t k = 0; k < sizeof others / sizeof others[0]; k++)
        other |= sdp_flag(c_mod, others[k]) == 1;
    /* cuDNN attention alone on is a choice (an sdpa_kernel(CUDNN_ATTENTION)
     * block CUDA starts in, say): off, no backend would be left to run. */
    if (on && !other) {
        snprintf(kb.reason[i] + len, sizeof kb.reason[i] - len,
                 "; cuDNN attention was the only SDPA backend on when CUDA started "
                 "(the program's or an sdpa_kernel() block's choice), left on");
        Py_DECREF(c_mod);
        return OC_KBC_NOT_AVOIDED;
    }
    /* Already off (the program said so, or OUTOFCUDA was told): nothing to do.
     * Off after a run a Ctrl-C cut short is taken for that run's own write,
     * found done and made again. */
    if (!on && oc_cuda_step_state(OC_STEP_KNOWN_BUGS) != OC_STEP_IS_INTERRUPTED) {
        snprintf(kb.reason[i] + len, sizeof kb.reason[i] - len,
                 "; cuDNN attention was already off");
        Py_DECREF(c_mod);
        return OC_KBC_AVOIDED;
    }
    rc = oc_call_bool(c_mod, "_set_sdp_use_cudnn", 0);
    Py_DECREF(c_mod);
    OC_CLEAR();
    if (rc != 1) {
        snprintf(kb.reason[i] + len, sizeof kb.reason[i] - len, "; torch._C._set_sdp_use_cudnn %s",
                 rc == 0 ? "is missing" : "failed");
        return OC_KBC_NOT_AVOIDED;
    }
    snprintf(kb.reason[i] + len, sizeof kb.reason[i] - len, "; when CUDA started: %s",
             b->action_text);
    oc_record_note(OC_OPT_SDPA, OC_NOTE_CUDNN_ATTENTION_OFF, b->id);
    return OC_KBC_AVOIDED;
}

void oc_known_bugs_at_cuda_init(PyObject *torch)
{
    size_t n = oc_known_bug_count();
    if (!kb.decided || torch == NULL)
        return;
    if (kb.cudnn < 0 && kb.need_cudnn)
        kb.cudnn = read_cudnn_version(torch);
    if (kb.redecide) /* the IPC steer alone decides nothing again */
        decide_all(torch, n);
    for (size_t i = 0; i < n; i++) {
        size_t len = strlen(kb.reason[i]);
        oc_kb_code c =
            kb.code[i] == OC_KBC_APPLIES ? act(torch, oc_known_bug_at(i), i) : kb.code[i];
        /* A row a Ctrl-C cut short stays as decided: the step runs again, and
         * its action reads torch's flag afresh (act). */
        if (oc_interrupt_waiting())
            kb.reason[i][len] = '\0';
        else
            kb.code[i] = c;
    }
    OC_CLEAR();
}

/* Whether cuDNN attention is off at the moment status() is called, where
 * its guard applies: "off" or "on" (a program's or an sdpa_kernel() block's
 * choice, or a block open when CUDA started set it back on at its exit), or
 * NULL when torch's flag cannot be read; words appended to text. */
static const char *guard_now(const oc_known_bug *b, char *text, size_t sz)
{
    PyObject *torch, *c_mod;
    int on;
    size_t len = strlen(text);
    if (b->action != OC_KB_SDPA_NO_CUDNN)
        return NULL;
    torch = oc_sys_module("torch");
    c_mod = torch ? PyObject_GetAttrString(torch, "_C") : NULL;
    OC_CLEAR();
    on = c_mod ? sdp_flag(c_mod, "_get_cudnn_sdp_enabled") : -1;
    Py_XDECREF(c_mod);
    Py_XDECREF(torch);
    if (on < 0)
        return NULL;
    snprintf(text + len, sz - len, "; now: cuDNN attention is %s", on ? "on" : "off");
    return on ? "on" : "off";
}

/* What outofcuda does about a row, in one word: "guard" (a steer the off
 * switch turns off), "own" (how outofcuda itself sets torch avoids it:
 * nothing to turn off), "named" (a line in doctor and the summary). */
static const char *kind_word(const oc_known_bug *b)
{
    return b->action == OC_KB_REPORT ? "named" : b->action == OC_KB_TF32_LEGACY ? "own" : "guard";
}

/* status()'s words: verdicts by OC_KB_YES, OC_KB_NO, OC_KB_UNDECIDED; codes. */
static const char *const verdict_words[] = {"not_affected", "applies", "undecided"};
#define OC_KB_NAME(id, name) name,
static const char *const code_names[] = {OC_KB_CODES(OC_KB_NAME)};

static PyObject *entry_dict(const oc_known_bug *b, oc_kb_code code, const char *reason,
                            const char *now)
{
    int v = oc_kb_verdict(code);
    return Py_BuildValue("{s:s,s:s,s:s,s:O,s:s,s:s,s:O,s:s,s:s,s:s,s:z,s:z,s:s,s:s}", "id", b->id,
                         "title", b->title, "evidence", b->evidence, "applies",
                         v < 0 ? Py_None
                         : v   ? Py_True
                               : Py_False,
                         "verdict", verdict_words[v < 0 ? 2 : v], "code", code_names[code], "done",
                         code == OC_KBC_AVOIDED ? Py_True : Py_False, "action", b->action_text,
                         "condition", b->condition, "reason", reason, "now", now, "fixed_in",
                         b->fixed_in, "fix", b->fix, "kind", kind_word(b));
}

/* Appends one entry to list; on failure drops the list and returns NULL. */
static PyObject *append_entry(PyObject *list, const oc_known_bug *b, oc_kb_code code,
                              const char *reason, const char *now)
{
    PyObject *e = entry_dict(b, code, reason, now);
    if (e == NULL || PyList_Append(list, e) < 0) {
        Py_XDECREF(e);
        Py_DECREF(list);
        return NULL;
    }
    Py_DECREF(e);
    return list;
}

/* Row i decided again from what NVML lists now (a row that needs this
 * process's contexts): its code, reason into text. */
static oc_kb_code decide_live(size_t i, char *text, size_t sz)
{
    const oc_known_bug *b = oc_known_bug_at(i);
    PyObject *torch;
    oc_kb_facts f;
    if (!(b->needs & OC_KB_NEEDS_FOREIGN_CTX) || kb.code[i] != OC_KBC_NEEDS_FACT)
        return kb.code[i];
    torch = oc_sys_module("torch");
    if (torch == NULL)
        return kb.code[i];
    facts_init(&f);
    torch_facts(torch, &f);
    Py_DECREF(torch);
    f.getenv_fn = proc_getenv;
    f.foreign_dev = live_foreign_device(f.local_rank);
    return oc_known_bug_decide(b, &f, text, sz);
}

PyObject *oc_known_bugs_status(void)
{
    PyObject *list = PyList_New(0);
    size_t n = oc_known_bug_count();
    for (size_t i = 0; list != NULL && i < n; i++) {
        char reason[sizeof kb.reason[i] + 200];
        const char *now = NULL;
        oc_kb_code code = oc_disabled_by_env() ? OC_KBC_OFF : OC_KBC_NOT_IMPORTED;
        snprintf(reason, sizeof reason, "%s",
                 kb.decided           ? kb.reason[i]
                 : code == OC_KBC_OFF ? OC_DISABLED_TEXT
                                      : "torch has not been imported by the hook in this process");
        if (kb.decided)
            code = decide_live(i, reason, sizeof reason);
        if (oc_kb_verdict(code) == OC_KB_YES)
            now = guard_now(oc_known_bug_at(i), reason, sizeof reason);
        list = append_entry(list, oc_known_bug_at(i), code, reason, now);
    }
    return list;
}

size_t oc_known_bugs_summary(char *buf, size_t sz, const char *prefix)
{
    size_t len = 0, n = oc_known_bug_count();
    if (buf == NULL || sz == 0)
        return 0;
    buf[0] = '\0';
    for (size_t i = 0; kb.decided && i < n && len + 1 < sz; i++) {
        const oc_known_bug *b = oc_known_bug_at(i);
        char why[sizeof kb.reason[i] + 200];
        oc_kb_code code;
        snprintf(why, sizeof why, "%s", kb.reason[i]);
        code = decide_live(i, why, sizeof why);
        /* Named where it applies and outofcuda does not avoid it; the
         * report-only rows that depend on how the program trains (FSDP2,
         * pooling) stay in doctor, where they are one line each. */
        if (oc_kb_verdict(code) != OC_KB_YES || code == OC_KBC_AVOIDED ||
            (b->action >= OC_KB_REPORT && oc_range_any(b->cudnn) && !b->needs))
            continue;
        snprintf(buf + len, sz - len, "%s  known bug      %s: %s (%s); fix: %s%s%s\n", prefix,
                 b->id, why, b->evidence, b->fix, b->fixed_in ? "; fixed in " : "",
                 b->fixed_in ? b->fixed_in : "");
        len += strlen(buf + len);
    }
    return len;
}

/* getenv over a Python mapping (ctx); the value lives in a static buffer
 * until the next call. */
static const char *mapping_getenv(const char *name, void *ctx)
{
    static char value[256];
    PyObject *v = ctx && ctx != Py_None ? PyMapping_GetItemString(ctx, name) : NULL;
    const char *r = NULL;
    if (v != NULL && PyUnicode_Check(v))
        r = oc_utf8(v, value, sizeof value);
    Py_XDECREF(v);
    OC_CLEAR();
    return r;
}

/* _known_bugs_check(torch_version, cuda_build, cudnn_version, ccs, env) ->
 * list of entries: the table evaluated on given facts, nothing acted on
 * (doctor, tests). None for a fact means unknown; cuda_build is a bool or
 * torch.version.cuda ("13.0"); ccs are major*10+minor; env's LOCAL_RANK is
 * the rank (no process list is read: a row that needs one stays undecided). */
static PyObject *py_known_bugs_check(PyObject *self, PyObject *args)
{
    const char *tver, *lr;
    PyObject *cuda, *cudnn, *ccs, *env, *list, *torch;
    oc_kb_facts f;
    (void)self;
    if (!PyArg_ParseTuple(args, "zOOOO", &tver, &cuda, &cudnn, &ccs, &env))
        return NULL;
    facts_init(&f);
    f.torch = tver ? oc_torch_version_number(tver) : 0;
    if (PyUnicode_Check(cuda)) {
        char buf[32];
        f.cuda_build = 1;
        f.cuda = cuda_number(oc_utf8(cuda, buf, sizeof buf));
    } else {
        f.cuda_build = cuda == Py_None ? -1 : PyObject_IsTrue(cuda);
    }
    f.cudnn = cudnn == Py_None ? -1 : PyLong_AsLong(cudnn);
    if (ccs != Py_None) {
        Py_ssize_t k = PySequence_Size(ccs);
        f.n_cc = 0;
        for (Py_ssize_t i = 0; i < k && f.n_cc < OC_KB_MAX_DEVICES; i++) {
            PyObject *item = PySequence_GetItem(ccs, i);
            f.cc[f.n_cc++] = item ? (int)PyLong_AsLong(item) : -1;
            Py_XDECREF(item);
        }
    }
    if (PyErr_Occurred())
        return NULL;
    f.getenv_fn = mapping_getenv;
    f.ctx = env;
    f.other_cudnn = other_cudnn(mapping_getenv(OC_VAR("LD_LIBRARY_PATH"), env));
    torch = oc_sys_module("torch");
    f.nccl = dist_version(torch, "nvidia_nccl_cu", f.cuda);
    Py_XDECREF(torch);
    lr = mapping_getenv(OC_VAR("LOCAL_RANK"), env);
    if (lr != NULL) {
        char *end;
        long r = strtol(lr, &end, 10);
        f.local_rank = *lr && *end == '\0' && r >= 0 && r < 1000000 ? r : -1;
    }
    list = PyList_New(0);
    for (size_t i = 0; list != NULL && i < oc_known_bug_count(); i++) {
        char why[400];
        const oc_known_bug *b = oc_known_bug_at(i);
        list = append_entry(list, b, oc_known_bug_decide(b, &f, why, sizeof why), why, NULL);
    }
    return list;
}

/* _visible_ccs() -> [major*10+minor, ...] of the GPUs CUDA shows this
 * process, from NVML (no CUDA context), or None when NVML cannot tell. */
static PyObject *py_visible_ccs(PyObject *self, PyObject *unused)
{
    oc_kb_facts f;
    PyObject *list;
    (void)self;
    (void)unused;
    device_facts(&f);
    if (f.n_cc < 0)
        Py_RETURN_NONE;
    list = PyList_New(0);
    for (int i = 0; list != NULL && i < f.n_cc; i++) {
        PyObject *v = PyLong_FromLong(f.cc[i]);
        if (v == NULL || PyList_Append(list, v) < 0) {
            Py_XDECREF(v);
            Py_CLEAR(list);
            break;
        }
        Py_DECREF(v);
    }
    return list;
}

OC_EDGE_NOARGS(py_visible_ccs)
OC_EDGE_VARARGS(py_known_bugs_check)

PyMethodDef oc_known_bugs_methods[] = {
    OC_METHOD("_visible_ccs", py_visible_ccs,
              "_visible_ccs()\n--\n\nCompute capabilities (major*10+minor) of the visible GPUs, "
              "from NVML."),
    OC_METHOD("_known_bugs_check", py_known_bugs_check,
              "_known_bugs_check(torch_version, cuda_build, cudnn, ccs, env, /)\n--\n\n"
              "Evaluate the known-bugs table on given facts (nothing is changed)."),
    {NULL, NULL, 0, NULL},
};
