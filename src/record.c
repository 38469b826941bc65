/* record.c - the typed record of every optimisation: its state, a stable
 * code for why, the sentence for people, and the typed values other files
 * read. Pure C: status() and the verbose table (report.c) render it. Every
 * record is written and read with the GIL held, as the rest of the engine's
 * state. */
#include "oc.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static oc_record records[OC_OPT_COUNT];

/* bfloat16 BatchNorm never reaches cuDNN (torch's _select_batch_norm_backend)
 * and cuDNN's NCHW path is slow in bfloat16: measured 0.82x on an H100. */
static const oc_cost costs[] = {{NULL, NULL, {NULL, NULL}},
                                {"bf16_conv",
                                 "slower on convolution networks in eager NCHW (0.82x on an H100)",
                                 {"OUTOFCUDA_AMP_DTYPE=float16", "channels_last"}}};

const oc_cost *oc_cost_get(oc_cost_id cost)
{
    return cost > OC_COST_NONE && cost <= OC_COST_BF16_CONV ? &costs[cost] : NULL;
}

#define OC_ROW_OF(id, name, setter, getter, var, does) {name, setter, getter, var, does},
static const oc_opt_row rows[] = {OC_OPTIMISATIONS(OC_ROW_OF)};
#undef OC_ROW_OF
#define OC_NAME_OF(id, name) name,
static const char *const state_names[] = {OC_REC_STATES(OC_NAME_OF)};
static const char *const code_names[] = {OC_REC_CODES(OC_NAME_OF)};
#undef OC_NAME_OF
#define OC_NOTE_OF(id, name, words) {name, words},
static const char *const notes[][2] = {OC_REC_NOTES(OC_NOTE_OF)};
#undef OC_NOTE_OF

static int valid(oc_opt opt)
{
    return (unsigned)opt < OC_OPT_COUNT;
}

const char *oc_opt_name(oc_opt opt)
{
    return valid(opt) ? rows[opt].name : "?";
}

const oc_opt_row *oc_opt_row_of(oc_opt opt)
{
    return valid(opt) ? &rows[opt] : NULL;
}

const char *oc_rec_state_name(oc_rec_state state)
{
    return (unsigned)state < OC_REC_STATE_COUNT ? state_names[state] : "?";
}

const char *oc_rec_code_name(oc_rec_code code)
{
    return (unsigned)code < OC_REC_CODE_COUNT ? code_names[code] : "?";
}

const char *oc_rec_note_name(oc_rec_note note)
{
    return (unsigned)note < OC_REC_NOTE_COUNT ? notes[note][0] : "?";
}

const oc_record *oc_record_get(oc_opt opt)
{
    return valid(opt) ? &records[opt] : NULL;
}

static void vset(oc_opt opt, oc_rec_state state, oc_rec_code code, const char *fmt, va_list ap)
{
    oc_record *r = &records[opt];
    r->state = state;
    r->code = code;
    r->off_by = NULL;
    r->cost = OC_COST_NONE;
    r->kind = OC_VAL_NONE;
    r->notes = 0;
    r->cc = 0;
    r->known_bug = r->variable = NULL;
    r->left_out[0] = '\0';
    vsnprintf(r->reason, sizeof r->reason, fmt, ap);
}

void oc_record_set(oc_opt opt, oc_rec_state state, oc_rec_code code, const char *fmt, ...)
{
    va_list ap;
    if (!valid(opt))
        return;
    va_start(ap, fmt);
    vset(opt, state, code, fmt, ap);
    va_end(ap);
}

void oc_record_off(oc_opt opt, const char *var)
{
    oc_record_set(opt, OC_REC_SKIPPED, OC_CODE_OFF, "off by %s: torch's own default kept", var);
    if (valid(opt))
        records[opt].off_by = var;
}

void oc_record_set_all(oc_rec_state state, oc_rec_code code, const char *reason)
{
    for (int i = 0; i < OC_OPT_COUNT; i++)
        oc_record_set((oc_opt)i, state, code, "%s", reason);
}

void oc_record_bool(oc_opt opt, int value)
{
    if (!valid(opt))
        return;
    /* TF32's flag is cuBLAS's, for matmuls (cuDNN TF32 is torch's default). */
    records[opt].kind = opt == OC_OPT_TF32 ? OC_VAL_MATMUL : OC_VAL_BOOL;
    records[opt].flag = value != 0;
}

void oc_record_sdpa(int flash, int mem_efficient, int math)
{
    oc_record *r = &records[OC_OPT_SDPA];
    r->kind = OC_VAL_SDPA;
    r->sdpa[0] = flash != 0;
    r->sdpa[1] = mem_efficient != 0;
    r->sdpa[2] = math != 0;
}

void oc_record_text(oc_opt opt, const char *text)
{
    if (!valid(opt))
        return;
    records[opt].kind = OC_VAL_TEXT;
    snprintf(records[opt].text, sizeof records[opt].text, "%s", text);
}

void oc_record_fraction(double fraction, long device)
{
    oc_record *r = &records[OC_OPT_FRACTION];
    r->kind = OC_VAL_FRACTION;
    r->fraction = fraction;
    r->device = device;
}

void oc_record_oom(const char *hooks, const char *observer, const char *snapshot)
{
    oc_record *r = &records[OC_OPT_OOM];
    r->kind = OC_VAL_OOM;
    if (hooks != NULL)
        r->oom.hooks = hooks;
    if (observer != NULL)
        snprintf(r->oom.observer, sizeof r->oom.observer, "%s", observer);
    if (snapshot != NULL)
        snprintf(r->oom.snapshot, sizeof r->oom.snapshot, "%s", snapshot);
}

void oc_record_note(oc_opt opt, oc_rec_note note, const char *known_bug)
{
    records[opt].notes |= 1u << note;
    if (known_bug != NULL)
        records[opt].known_bug = known_bug;
}

void oc_record_notes(oc_opt opt, unsigned bits, const char *variable, const char *left_out)
{
    records[opt].notes |= bits;
    records[opt].variable = variable;
    snprintf(records[opt].left_out, sizeof records[opt].left_out, "%s", left_out ? left_out : "");
}

void oc_record_capability(int cc)
{
    records[OC_OPT_AMP_DTYPE].cc = cc;
    records[OC_OPT_AMP_DTYPE].notes |= 1u << OC_NOTE_CAPABILITY_FROM_NVML;
}

void oc_record_chosen(double fraction, const char *variable)
{
    records[OC_OPT_FRACTION].fraction = fraction;
    records[OC_OPT_FRACTION].variable = variable;
}

void oc_record_cost(oc_opt opt, oc_cost_id cost)
{
    if (valid(opt))
        records[opt].cost = cost;
}

void oc_record_reason(oc_opt opt, char *buf, size_t sz)
{
    const oc_record *r = oc_record_get(opt);
    const oc_cost *cost;
    size_t len;
    if (sz == 0)
        return;
    snprintf(buf, sz, "%s", r ? r->reason : "");
    /* Words the notes add (cuDNN attention's, which the known-bugs guard
     * decides at CUDA's start, after the sentence was written). */
    for (int i = 0; r != NULL && i < OC_REC_NOTE_COUNT; i++) {
        len = strlen(buf);
        if ((r->notes >> i & 1u) && notes[i][1] != NULL && len < sz)
            snprintf(buf + len, sz - len, "; %s%s", notes[i][1],
                     i == OC_NOTE_UNKNOWN_KEYS_LEFT_OUT || i == OC_NOTE_NATIVE_KEYS_LEFT_OUT
                         ? r->left_out
                         : "");
    }
    len = strlen(buf);
    if (r == NULL || len >= sz)
        return;
    if (r->known_bug != NULL)
        snprintf(buf + len, sz - len, " (known bug %s)", r->known_bug);
    else if (opt == OC_OPT_SDPA && r->code == OC_CODE_TORCH_DEFAULT)
        snprintf(buf + len, sz - len, "; cuDNN attention left as torch has it");
    else if ((cost = oc_cost_get(r->cost)) != NULL)
        snprintf(buf + len, sz - len,
                 "; cost: %s; ways back: %s, or %s (outofcuda.compile_model applies it)",
                 cost->words, cost->ways_back[0], cost->ways_back[1]);
}
