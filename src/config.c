/* config.c - OUTOFCUDA_* environment -> oc_config, and oc_escape_text. Pure
 * C: no Python here, so the parser can be unit-tested and fuzzed on its own. */
#define OC_PURE_C
#include "oc.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The default that joins only where expandable segments end up off (see
 * OC_DEFAULT_ALLOC_CONF in oc.h; bridge.c decides). */
#define OC_DEFAULT_ALLOC_CONF_NO_EXPANDABLE "max_split_size_mb:128"

/* Length of the well-formed UTF-8 sequence at s (1 to 4), or 0 when the
 * bytes there are not one (a stray continuation byte, an overlong form, a
 * surrogate, a sequence cut short). */
static size_t utf8_len(const unsigned char *s)
{
    size_t n, i;
    if (s[0] < 0x80)
        return 1;
    if (s[0] >= 0xc2 && s[0] <= 0xdf)
        n = 2;
    else if (s[0] >= 0xe0 && s[0] <= 0xef)
        n = 3;
    else if (s[0] >= 0xf0 && s[0] <= 0xf4)
        n = 4;
    else
        return 0;
    for (i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
    }
    if ((s[0] == 0xe0 && s[1] < 0xa0) || (s[0] == 0xed && s[1] >= 0xa0) ||
        (s[0] == 0xf0 && s[1] < 0x90) || (s[0] == 0xf4 && s[1] >= 0x90))
        return 0;
    return n;
}

/* Whether a terminal must not get code point c as it is: C0 and C1 controls
 * and DEL (escape sequences, and U+009B is one on its own), and characters
 * that reorder or hide the text around them (bidi controls and isolates, the
 * Arabic letter mark, zero-width and invisible format characters, the line
 * and paragraph separators, the byte order mark). */
static int unsafe_char(unsigned long c)
{
    return c < 0x20 || (c >= 0x7f && c <= 0x9f) || c == 0x061c || c == 0x180e ||
           (c >= 0x200b && c <= 0x200f) || (c >= 0x2028 && c <= 0x202e) ||
           (c >= 0x2060 && c <= 0x206f) || c == 0xfeff || (c >= 0xfff9 && c <= 0xfffb);
}

void oc_escape_text(const char *text, char *out, size_t outsz, size_t max)
{
    const unsigned char *p = (const unsigned char *)text;
    size_t j = 0;
    if (outsz == 0)
        return;
    for (; *p != '\0' && max > 0; max--) {
        size_t n = utf8_len(p), len = n;
        unsigned long c = n > 1 ? p[0] & (0x7fu >> n) : p[0];
        const char *piece = (const char *)p;
        char esc[8];
        for (size_t i = 1; i < n; i++)
            c = c << 6 | (p[i] & 0x3fu);
        if (n == 0 || unsafe_char(c)) {
            len = (size_t)snprintf(esc, sizeof esc, c > 0xff ? "\\u%04lx" : "\\x%02lx", c);
            piece = esc;
            n = n > 0 ? n : 1;
        }
        if (j + len >= outsz)
            break; /* cut between characters */
        memcpy(out + j, piece, len);
        j += len;
        p += n;
    }
    out[j] = '\0';
    if (*p != '\0' && max == 0 && j + 3 < outsz)
        memcpy(out + j, "...", 4);
}

void oc_escape_controls(char *buf, size_t sz)
{
    char out[512];
    if (sz == 0)
        return;
    oc_escape_text(buf, out, sz < sizeof out ? sz : sizeof out, (size_t)-1);
    memcpy(buf, out, strlen(out) + 1);
}

static void add_warning(oc_config *cfg, const oc_setting *s, const char *value)
{
    char shown[200];
    if (cfg->n_warnings >= OC_WARN_MAX)
        return;
    oc_escape_text(value, shown, sizeof shown, 40);
    snprintf(cfg->warnings[cfg->n_warnings++], OC_WARN_LEN,
             "outofcuda: ignoring %s='%s': expected %s%s; using the default", s->name, shown,
             s->accepts, s->kind == OC_SET_BOOL ? "" : ", or " OC_OFF_WORDS " (off)");
}

/* Copies s without leading and trailing blanks into buf (lower-cased when
 * lower). Returns buf, or NULL when the trimmed text does not fit. */
static const char *trim_copy(const char *s, char *buf, size_t sz, int lower)
{
    const char *end;
    size_t n;
    while (*s && isspace((unsigned char)*s))
        s++;
    end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1]))
        end--;
    n = (size_t)(end - s);
    if (n >= sz)
        return NULL;
    for (size_t i = 0; i < n; i++)
        buf[i] = lower ? (char)tolower((unsigned char)s[i]) : s[i];
    buf[n] = '\0';
    return buf;
}

int oc_parse_bool(const char *s)
{
    /* The four on words, then the off words (OC_OFF_WORDS): the same for
     * every setting. */
    static const char *const words[] = {"1",   "true",  "yes", "on",  "0",
                                        "off", "false", "no",  "none"};
    char buf[8];
    if (s == NULL || trim_copy(s, buf, sizeof buf, 1) == NULL)
        return -1;
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) {
        if (strcmp(buf, words[i]) == 0)
            return i < 4;
    }
    return -1;
}

int oc_parse_off(const char *s)
{
    return oc_parse_bool(s) == 0;
}

int oc_config_off(const oc_config *cfg, const char *name)
{
    for (size_t i = 0; name != NULL && i < oc_setting_count() && i < 64; i++) {
        if (strcmp(oc_setting_at(i)->name, name) == 0)
            return (cfg->off & (1ull << i)) != 0;
    }
    return 0;
}

/* ---- one parser per kind of value: 0 stored, -1 refused (nothing stored) ---- */

/* The setting's field in cfg; numbers are stored with memcpy (the field's
 * type is the setting's kind's: int, long or double). */
#define FIELD(cfg, s) ((char *)(cfg) + (s)->offset)
#define STORE(cfg, s, x) memcpy(FIELD(cfg, s), &(x), sizeof(x))

static int parse_bool(oc_config *cfg, const oc_setting *s, const char *v)
{
    int b = oc_parse_bool(v);
    if (b < 0)
        return -1;
    STORE(cfg, s, b);
    return 0;
}

/* A whole number from s->lo to s->hi (OC_SET_LONG, a long field), or a
 * fraction f with 0 < f <= 1 or auto (OC_SET_FRACTION, a double field). */
static int parse_number(oc_config *cfg, const oc_setting *s, const char *v)
{
    char buf[32], *end;
    long whole = 0;
    double f = OC_FRACTION_AUTO;
    int ok;
    if (trim_copy(v, buf, sizeof buf, 1) == NULL || buf[0] == '\0')
        return -1;
    errno = 0;
    if (s->kind == OC_SET_LONG)
        whole = strtol(buf, &end, 10);
    else if (strcmp(buf, "auto") != 0)
        f = strtod(buf, &end);
    else {
        STORE(cfg, s, f); /* OC_FRACTION_AUTO */
        return 0;
    }
    /* isfinite() also refuses "nan" and "inf", which strtod accepts. */
    ok = errno == 0 && *end == '\0' &&
         (s->kind == OC_SET_LONG ? whole >= s->lo && whole <= s->hi
                                 : isfinite(f) && f > 0.0 && f <= 1.0);
    if (!ok)
        return -1;
    if (s->kind == OC_SET_LONG)
        STORE(cfg, s, whole);
    else
        STORE(cfg, s, f);
    return 0;
}

/* A word of s->words (any case, blanks around): its value from s->values
 * into an int field, or, without values, the canonical word into a
 * char[OC_WORD_MAX] field. */
static int parse_word(oc_config *cfg, const oc_setting *s, const char *v)
{
    char buf[40];
    if (trim_copy(v, buf, sizeof buf, 1) == NULL)
        return -1;
    for (size_t i = 0; s->words[i] != NULL; i++) {
        if (strcmp(buf, s->words[i]) != 0)
            continue;
        if (s->values != NULL)
            STORE(cfg, s, s->values[i]);
        else
            snprintf(FIELD(cfg, s), OC_WORD_MAX, "%s", s->words[i]);
        return 0;
    }
    return -1;
}

static int parse_alloc(oc_config *cfg, const oc_setting *s, const char *v)
{
    oc_alloc_list list;
    if (strlen(v) >= OC_ALLOC_CONF_MAX || oc_alloc_parse(v, &list, NULL, 0) != 0)
        return -1;
    snprintf(FIELD(cfg, s), OC_ALLOC_CONF_MAX, "%s", v);
    return 0;
}

/* OUTOFCUDA_SUMMARY: a boolean word (1: the block on stderr), or the path of
 * a JSON file to write instead, told apart by its ".json" ending so that a
 * typo such as "ture" is a warning, not a file called "ture". Whether the
 * directory exists is checked when the feature starts (summary.c). */
static int parse_summary(oc_config *cfg, const oc_setting *s, const char *v)
{
    char buf[OC_SUMMARY_PATH_MAX];
    const char *p;
    size_t n;
    int b = oc_parse_bool(v);
    (void)s;
    if (b >= 0) {
        cfg->summary = b ? OC_SUMMARY_STDERR : OC_SUMMARY_OFF;
        return 0;
    }
    p = trim_copy(v, buf, sizeof buf, 0);
    n = p ? strlen(p) : 0;
    for (size_t i = 0; p && i < n; i++)
        if ((unsigned char)p[i] < 0x20 || p[i] == 0x7f)
            p = NULL;
    if (p == NULL || n <= 5 || strcmp(p + n - 5, ".json") != 0 || p[n - 6] == '/')
        return -1;
    cfg->summary = OC_SUMMARY_JSON;
    snprintf(cfg->summary_path, sizeof cfg->summary_path, "%s", p);
    return 0;
}

/* An off word given to a setting whose own values do not take it: the
 * field holds what leaves torch's own default (a fraction of 0, no
 * allocator string, no word, 0), and cfg->off says the setting is off. */
static int parse_off(oc_config *cfg, const oc_setting *s, const char *v)
{
    static const int off_value = -1;
    if (!oc_parse_off(v))
        return -1;
    switch (s->kind) {
    case OC_SET_LONG:
    case OC_SET_FRACTION: /* 0 and 0.0: all bits zero */
        memset(FIELD(cfg, s), 0, s->kind == OC_SET_LONG ? sizeof(long) : sizeof(double));
        break;
    case OC_SET_WORD:
        if (s->values != NULL)
            STORE(cfg, s, off_value);
        else
            FIELD(cfg, s)[0] = '\0';
        break;
    case OC_SET_ALLOC:
        FIELD(cfg, s)[0] = '\0';
        break;
    case OC_SET_KNOWN_BUGS:
        cfg->known_bugs = 0;
        break;
    case OC_SET_BOOL:
    case OC_SET_SUMMARY:
    case OC_SET_TEXT:
    case OC_SET_FOREIGN:
        return -1;
    }
    return 0;
}

/* OUTOFCUDA_KNOWN_BUGS: a boolean word (every row on or off), or the ids of
 * the rows to turn off, separated by commas (src/kbtable.c's table). An
 * entry that is no row id gets one warning naming it and the ids; the
 * list's other ids still turn their rows off. */
static int parse_known_bugs(oc_config *cfg, const oc_setting *s, const char *v)
{
    char unknown[200], shown[200], *w;
    unsigned long off = 0;
    int b = oc_parse_bool(v);
    size_t n;
    if (b < 0 && oc_known_bugs_parse_off(v, &off, unknown, sizeof unknown) > 0 &&
        cfg->n_warnings < OC_WARN_MAX) {
        oc_escape_text(unknown, shown, sizeof shown, 60);
        w = cfg->warnings[cfg->n_warnings++];
        n = (size_t)snprintf(w, OC_WARN_LEN,
                             "outofcuda: ignoring '%s' in %s: no row has that id; "
                             "expected %s:",
                             shown, s->name, s->accepts);
        for (size_t i = 0; i < oc_known_bug_count() && n < OC_WARN_LEN; i++)
            n += (size_t)snprintf(w + n, OC_WARN_LEN - n, "%s %s", i ? "," : "",
                                  oc_known_bug_at(i)->id);
    }
    cfg->known_bugs = b < 0 ? 1 : b;
    cfg->known_bugs_off = off;
    return 0;
}

static int parse(oc_config *cfg, const oc_setting *s, const char *v)
{
    switch (s->kind) {
    case OC_SET_BOOL:
        return parse_bool(cfg, s, v);
    case OC_SET_LONG:
    case OC_SET_FRACTION:
        return parse_number(cfg, s, v);
    case OC_SET_WORD:
        return parse_word(cfg, s, v);
    case OC_SET_ALLOC:
        return parse_alloc(cfg, s, v);
    case OC_SET_SUMMARY:
        return parse_summary(cfg, s, v);
    case OC_SET_KNOWN_BUGS:
        return parse_known_bugs(cfg, s, v);
    case OC_SET_TEXT:
    case OC_SET_FOREIGN:
        break;
    }
    return -1;
}

/* Edits (insert, delete, replace, swap two neighbours) from a to b, each at
 * most 63 characters; a longer name counts as far from everything. */
static size_t edit_distance(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b), d[64][64];
    if (la >= 64 || lb >= 64)
        return (size_t)-1;
    for (size_t i = 0; i <= la; i++)
        d[i][0] = i;
    for (size_t j = 0; j <= lb; j++)
        d[0][j] = j;
    for (size_t i = 1; i <= la; i++) {
        for (size_t j = 1; j <= lb; j++) {
            size_t best = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
            if (d[i - 1][j] + 1 < best)
                best = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < best)
                best = d[i][j - 1] + 1;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] &&
                d[i - 2][j - 2] + 1 < best)
                best = d[i - 2][j - 2] + 1;
            d[i][j] = best;
        }
    }
    return d[la][lb];
}

void oc_config_check_names(oc_config *cfg, char *const *env)
{
    static const char prefix[] = "OUTOFCUDA_";
    for (; env != NULL && *env != NULL; env++) {
        char name[128] = "", shown[200], hint[96] = "";
        const char *eq = strchr(*env, '='), *closest = NULL;
        size_t len = eq ? (size_t)(eq - *env) : strlen(*env), best = 4;
        if (strncmp(*env, prefix, sizeof prefix - 1) != 0 || cfg->n_warnings >= OC_WARN_MAX)
            continue;
        /* Read by the build (setup.py) and by outofcuda's own test harness,
         * never at run time: a shell that exports them is not mistaken. */
        if (strncmp(*env, "OUTOFCUDA_BUILD_", 16) == 0 || strncmp(*env, "OUTOFCUDA_TEST_", 15) == 0)
            continue;
        if (len < sizeof name) {
            memcpy(name, *env, len);
            name[len] = '\0';
            if (oc_setting_named(name) != NULL)
                continue;
        }
        /* A name is any bytes but '=': escaped as values are. */
        oc_escape_text(len < sizeof name ? name : *env, shown, sizeof shown, 60);
        /* The closest name of the one table, when a typo is likely (at most
         * three edits away). */
        for (size_t i = 0; len < sizeof name && i < oc_setting_count(); i++) {
            const oc_setting *s = oc_setting_at(i);
            size_t dist;
            if (strncmp(s->name, prefix, sizeof prefix - 1) != 0)
                continue;
            dist = edit_distance(name, s->name);
            if (dist < best)
                best = dist, closest = s->name;
        }
        if (closest != NULL)
            snprintf(hint, sizeof hint, "; did you mean %s?", closest);
        snprintf(cfg->warnings[cfg->n_warnings++], OC_WARN_LEN,
                 "outofcuda: ignoring %s: not a variable outofcuda reads%s", shown, hint);
    }
}

void oc_config_load(oc_config *cfg, oc_getenv_fn get, void *ctx)
{
    size_t n = oc_setting_count();
    memset(cfg, 0, sizeof *cfg);
    /* Defaults go through the same parsers as values: the table's default
     * is what docs/environment.md shows and what the loader starts from. */
    for (size_t i = 0; i < n; i++) {
        const oc_setting *s = oc_setting_at(i);
        if (s->offset != OC_NO_FIELD && s->default_text != NULL)
            parse(cfg, s, s->default_text);
    }
    snprintf(cfg->alloc_conf_no_expandable, sizeof cfg->alloc_conf_no_expandable, "%s",
             OC_DEFAULT_ALLOC_CONF_NO_EXPANDABLE);
    for (size_t i = 0; i < n; i++) {
        const oc_setting *s = oc_setting_at(i);
        const char *v;
        int own;
        if (s->offset == OC_NO_FIELD)
            continue;
        v = get(s->name, ctx);
        /* `OUTOFCUDA_X=` (an env file's blank entry, `docker run -e X=`)
         * means "not set", not a bad value. */
        if (v == NULL || v[0] == '\0')
            continue;
        /* The setting's own values first (OUTOFCUDA_NUM_WORKERS=0 is the
         * number 0), then the off words every setting takes. */
        own = parse(cfg, s, v) == 0;
        if (!own && parse_off(cfg, s, v) != 0) {
            add_warning(cfg, s, v);
            continue;
        }
        if (i < 64 && oc_parse_off(v) &&
            (!own || s->kind == OC_SET_BOOL || s->kind == OC_SET_SUMMARY ||
             s->kind == OC_SET_KNOWN_BUGS))
            cfg->off |= 1ull << i;
        if (s->kind == OC_SET_ALLOC)
            /* The user's own string, or off, replaces every default, conditional ones too. */
            cfg->alloc_conf_no_expandable[0] = '\0';
    }
}

int oc_tf32_forced_off(const char *v)
{
    char buf[4];
    /* NVIDIA documents NVIDIA_TF32_OVERRIDE=0 as the switch; " 0" (an env
     * file's stray blank) is read the same way: the off switch errs on the
     * side of the precision the user asked for. */
    return v != NULL && trim_copy(v, buf, sizeof buf, 0) != NULL && strcmp(buf, "0") == 0;
}
