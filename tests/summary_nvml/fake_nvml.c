/* fake_nvml.c - a stand-in libnvidia-ml.so.1 for the exit-summary tests
 * (no GPU and no driver here). It exports the entry points src/nvml.c
 * requires at load plus the ones the summary reads, and serves figures from
 * the file named by OC_FAKE_NVML_FILE, one line per device:
 *
 *     <used bytes> <total bytes> <util> <util> ... [+]
 *
 * Each nvmlDeviceGetUtilizationRates call on a device returns its next
 * utilisation value; after the last one it fails with NVML_ERROR_NOT_SUPPORTED,
 * or, when the line ends with "+", repeats the last value for ever, or, when
 * it ends with "hang", never returns (a driver call stuck in a broken driver)
 * once it has created "<file>.hanging".
 * So a test knows exactly which samples the sampler saw. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define OK 0
#define ERROR_INVALID_ARGUMENT 2
#define ERROR_NOT_SUPPORTED 3
#define MAX_DEVICES 16
#define MAX_VALUES 256

typedef struct {
    unsigned long long total, free, used;
} memory_t;
typedef struct {
    unsigned int gpu, memory;
} utilization_t;

static struct {
    unsigned long long used, total;
    unsigned values[MAX_VALUES];
    int n_values, repeat, hang;
} dev[MAX_DEVICES];
static int n_dev = -1;
static int served[MAX_DEVICES];

static void load(void)
{
    const char *path = getenv("OC_FAKE_NVML_FILE");
    char line[4096];
    FILE *f;
    if (n_dev >= 0)
        return;
    n_dev = 0;
    f = path ? fopen(path, "r") : NULL;
    while (f && n_dev < MAX_DEVICES && fgets(line, sizeof line, f)) {
        char *tok = strtok(line, " \t\n");
        int field = 0;
        memset(&dev[n_dev], 0, sizeof dev[n_dev]);
        for (; tok; tok = strtok(NULL, " \t\n"), field++) {
            if (field == 0)
                dev[n_dev].used = strtoull(tok, NULL, 10);
            else if (field == 1)
                dev[n_dev].total = strtoull(tok, NULL, 10);
            else if (strcmp(tok, "+") == 0)
                dev[n_dev].repeat = 1;
            else if (strcmp(tok, "hang") == 0)
                dev[n_dev].hang = 1;
            else if (dev[n_dev].n_values < MAX_VALUES)
                dev[n_dev].values[dev[n_dev].n_values++] = (unsigned)strtoul(tok, NULL, 10);
        }
        if (field >= 2)
            n_dev++;
    }
    if (f)
        fclose(f);
}

/* Leaves "<file>.hanging" for the test to wait on, then never returns. */
static void hang(void)
{
    char mark[4200];
    FILE *f;
    snprintf(mark, sizeof mark, "%s.hanging", getenv("OC_FAKE_NVML_FILE"));
    f = fopen(mark, "w");
    if (f)
        fclose(f);
    for (;;)
        pause();
}

static int index_of(void *handle)
{
    intptr_t i = (intptr_t)handle - 1;
    return (i >= 0 && i < n_dev) ? (int)i : -1;
}

int nvmlInit_v2(void)
{
    load();
    return OK;
}

int nvmlShutdown(void)
{
    return OK;
}

int nvmlDeviceGetCount_v2(unsigned int *count)
{
    load();
    *count = (unsigned)n_dev;
    return OK;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **handle)
{
    load();
    if ((int)index >= n_dev)
        return ERROR_INVALID_ARGUMENT;
    *handle = (void *)(intptr_t)(index + 1);
    return OK;
}

int nvmlDeviceGetName(void *handle, char *name, unsigned int length)
{
    int i = index_of(handle);
    if (i < 0)
        return ERROR_INVALID_ARGUMENT;
    snprintf(name, length, "Stand-in GPU %d", i);
    return OK;
}

int nvmlDeviceGetMemoryInfo(void *handle, memory_t *mem)
{
    int i = index_of(handle);
    if (i < 0)
        return ERROR_INVALID_ARGUMENT;
    mem->total = dev[i].total;
    mem->used = dev[i].used;
    mem->free = dev[i].total - dev[i].used;
    return OK;
}

int nvmlDeviceGetUtilizationRates(void *handle, utilization_t *u)
{
    int i = index_of(handle), k;
    if (i < 0)
        return ERROR_INVALID_ARGUMENT;
    k = served[i];
    if (k >= dev[i].n_values) {
        if (dev[i].hang)
            hang();
        if (!dev[i].repeat || dev[i].n_values == 0)
            return ERROR_NOT_SUPPORTED;
        k = dev[i].n_values - 1;
    } else {
        served[i]++;
    }
    u->gpu = dev[i].values[k];
    u->memory = dev[i].values[k] / 2;
    return OK;
}
