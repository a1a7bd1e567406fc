/* Files kiln reads and writes on a user's behalf (src/core/file.c): every room above
 * core opens a model, tokenizer, config or metrics file through here, and saves one
 * through here, so that the rules below hold everywhere.
 *
 * Reading: only a regular file is opened. A FIFO, a device or a socket is refused
 * without blocking (the open does not wait for a writer), a directory is named as
 * one, and the file cannot turn into something else between the check and the read
 * (the check is on the open descriptor).
 *
 * Writing: a whole file, atomically. The bytes go to a fresh temporary file beside the
 * target; every write, the flush, the fsync and the close are checked; only then is the
 * temporary renamed over the target and the folder synced. Any failure (a full disk, a
 * failed fsync) removes the temporary and leaves the previous file as it was. A target
 * that exists and is not a regular file is refused: a device, a FIFO, a folder, and a
 * symbolic link too, even to a regular file (the rename would replace the link, not the
 * file it names, which is rarely what the user meant; name the file itself). The
 * check and the rename are two steps: a target swapped between them by another process
 * is not defended against.
 *
 *     kiln__afile a;
 *     if (kiln__afile_begin(&a, path, "gguf") != KILN_OK) return kiln_last_status();
 *     kiln_status s = kiln__afile_write(&a, header, n);
 *     if (s == KILN_OK) s = kiln__afile_write(&a, data, m);
 *     return s == KILN_OK ? kiln__afile_commit(&a) : (kiln__afile_abort(&a), s);
 *
 * Errors go to the thread's last-error buffer as "WHO: PATH: what (strerror)". */
#ifndef KILN_CORE_FILE_H
#define KILN_CORE_FILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include "kiln/tensor.h"

/* who, in every function here, begins the error messages ("--chat-template: cannot open
 * ..."): a flag, a variable or a kind of file the user knows; NULL when the path is enough.
 * Never an internal function's name. */

/* ---- reading ---- */

/* Opens path for reading if it is a regular file; the descriptor (close-on-exec,
 * blocking) or -1 with the error set. *size (may be NULL) is the file's size. */
int kiln__file_open_read(const char *path, const char *who, int64_t *size);
/* The same as a stdio stream ("rb"); NULL with the error set. */
FILE *kiln__file_fopen_read(const char *path, const char *who);
/* KILN_OK if path does not exist or is a regular file, else the error (for a reader
 * that lets a library open the file itself, like dlopen). */
kiln_status kiln__file_check_regular(const char *path, const char *who);

/* ---- writing ---- */

/* A file being written: write through kiln__afile_write, then commit or abort. */
typedef struct {
    int fd, err; /* err: the errno of a failed write */
    char *path, *tmp;
    const char *who;
} kiln__afile;

/* Refuses path if it exists and is not a regular file (see above), then creates the
 * temporary file beside it. On failure nothing is left behind and a needs no abort. */
kiln_status kiln__afile_begin(kiln__afile *a, const char *path, const char *who);
/* Writes all n bytes (retrying short writes); on failure the error names the path and
 * errno, and the caller still commits or aborts (commit then fails). */
kiln_status kiln__afile_write(kiln__afile *a, const void *p, size_t n);
/* fsync, close, the target checked again, rename, the folder synced; on failure the
 * temporary is removed and the target is as it was. Frees a either way. */
kiln_status kiln__afile_commit(kiln__afile *a);
/* Removes the temporary; the target is untouched. Frees a. */
void kiln__afile_abort(kiln__afile *a);
/* begin, write, commit of one buffer. */
kiln_status kiln__file_write_atomic(const char *path, const void *p, size_t n, const char *who);
/* For a file another program wrote (a compiler's output): tmp renamed over path, which
 * is refused as kiln__afile_begin refuses it; tmp is removed on failure. */
kiln_status kiln__file_place(const char *tmp, const char *path, const char *who);
/* KILN_OK if path does not exist or is a regular file, else the error naming why a
 * save there is refused. */
kiln_status kiln__file_check_target(const char *path, const char *who);
/* Opens path for reading and appending (created if missing) if it is, or will be, a regular file;
 * refused like kiln__afile_begin, without blocking on a FIFO. The descriptor or -1. */
int kiln__file_open_append(const char *path, const char *who);

/* ---- identity ---- */

/* True when a and b both exist and are the same file or folder (device and inode:
 * through links, bind mounts and other spellings of the path). */
bool kiln__file_same(const char *a, const char *b);

#endif
