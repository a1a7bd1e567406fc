/* An output that is its own input: `kiln import hf X X`, `kiln export gguf RUN
 * RUN/model.safetensors`, a tokenizer written over its corpus. Each would replace the
 * files the command reads with the files it writes; they are refused before any work. */
#include <fnmatch.h>
#include <libgen.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include "cli.h"
#include "core/file.h"

/* The names a model folder is read from (a kiln run folder or a Hugging Face one). */
static const char *const model_files[] = {"config.json", "tokenizer.json", "tokenizer_config.json", "*.safetensors",
                                          "*.safetensors.index.json", "generation_config.json", NULL};

/* The folder holding path (path's own copy is not changed). */
static void parent_of(const char *path, char *out, size_t n)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s", path);
    snprintf(out, n, "%s", dirname(tmp));
}

static bool is_dir(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

int cli_refuse_own_input(const char *cmd, const char *in, const char *out, bool folder_is_input)
{
    char folder[4096], out_dir[4096], base[4096];
    if (kiln__file_same(in, out)) {
        fprintf(stderr, "kiln %s: the output %s is the input %s; write it elsewhere\n", cmd, out, in);
        return 1;
    }
    /* a model given as its file is read with its folder's tokenizer */
    if (is_dir(in)) snprintf(folder, sizeof folder, "%s", in);
    else parent_of(in, folder, sizeof folder);
    if (is_dir(out)) {
        if (!folder_is_input && kiln__file_same(folder, out)) {
            fprintf(stderr, "kiln %s: the output folder %s is the folder %s is read from; write it elsewhere\n", cmd,
                    out, in);
            return 1;
        }
        return 0;
    }
    struct stat st;
    if (lstat(out, &st) != 0 || !is_dir(folder)) return 0; /* a new file is nobody's input */
    parent_of(out, out_dir, sizeof out_dir);
    if (!kiln__file_same(out_dir, folder)) return 0;
    snprintf(base, sizeof base, "%s", out);
    const char *name = basename(base);
    bool read = folder_is_input && is_dir(in);
    for (int i = 0; !read && model_files[i]; i++) read = fnmatch(model_files[i], name, 0) == 0;
    if (read) {
        fprintf(stderr, "kiln %s: the output %s is one of the files %s is read from; write it elsewhere\n", cmd, out,
                in);
        return 1;
    }
    return 0;
}
