/* The error state: one message per thread, set by whichever internal function fails and read back by the caller
 * through ktk_last_error (api.c). Kept apart from api.c so that the files below the API (pool, dispatch, forward,
 * ...) can report errors without depending on the API layer above them.
 */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

static _Thread_local char t_msg[KTKI_MSG_LEN];

int ktki_error(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_msg, sizeof t_msg, fmt, ap);
    va_end(ap);
    return code;
}

void ktki_error_clear(void) { t_msg[0] = 0; }
const char *ktki_error_msg(void) { return t_msg; }
void ktki_error_set_msg(int code, const char *msg) {
    (void)code;
    snprintf(t_msg, sizeof t_msg, "%s", msg);
}
