/* Drives the pure-C known-bugs lookup (src/knownbugs.c built with
 * OC_PURE_C, no Python): one case a line on stdin,
 *   torch cuda_build cudnn n_cc cc... env
 * where env is "-" (unset) or the value of the entry's unless-variable; one
 * line out per case and entry: "<entry id> <decision> <why>". */
#include "../../src/oc.h"

#include <stdio.h>
#include <string.h>

static const char *env_value;

static const char *one_env(const char *name, void *ctx)
{
    (void)name;
    (void)ctx;
    return env_value;
}

int main(void)
{
    char line[4096], env[256];
    while (fgets(line, sizeof line, stdin) != NULL) {
        oc_kb_facts f;
        char *p = line;
        int used = 0;
        memset(&f, 0, sizeof f);
        if (sscanf(p, "%ld %d %ld %d%n", &f.torch, &f.cuda_build, &f.cudnn, &f.n_cc, &used) != 4)
            continue;
        p += used;
        for (int i = 0, cc; i < f.n_cc; i++) {
            if (sscanf(p, "%d%n", &cc, &used) != 1)
                break;
            if (i < OC_KB_MAX_DEVICES) /* the rest are read past, as a table would */
                f.cc[i] = cc;
            p += used;
        }
        if (sscanf(p, "%255s", env) != 1)
            snprintf(env, sizeof env, "-");
        env_value = strcmp(env, "-") == 0 ? NULL : env;
        f.getenv_fn = one_env;
        for (size_t i = 0; i < oc_known_bug_count(); i++) {
            char why[400];
            int d = oc_known_bug_decide(oc_known_bug_at(i), &f, why, sizeof why);
            printf("%s %d %s\n", oc_known_bug_at(i)->id, d, why);
        }
        fflush(stdout);
    }
    return oc_known_bug_at(oc_known_bug_count()) == NULL ? 0 : 1;
}
