#include <string.h>
#include "core/dtype.h"
#include "core/tensor_impl.h"

/* One row per dtype: name, aliases, size, float? */
static const struct {
    const char *name, *alias;
    size_t size;
    bool is_float;
} dtypes[KILN_DTYPE_COUNT] = {
    [KILN_DTYPE_F32] = {"f32", "float32", 4, true},
    [KILN_DTYPE_F64] = {"f64", "float64", 8, true},
    [KILN_DTYPE_F16] = {"f16", "float16", 2, true},
    [KILN_DTYPE_BF16] = {"bf16", "bfloat16", 2, true},
    [KILN_DTYPE_I32] = {"i32", "int32", 4, false},
    [KILN_DTYPE_I64] = {"i64", "int64", 8, false},
    [KILN_DTYPE_U8] = {"u8", "uint8", 1, false},
    [KILN_DTYPE_BOOL] = {"bool", "bool", 1, false},
};
_Static_assert(KILN_DTYPE_COUNT == 8, "a new dtype needs a row in dtypes[]");

const char *kiln_dtype_name(kiln_dtype dt)
{
    return (unsigned)dt < KILN_DTYPE_COUNT ? dtypes[dt].name : "?";
}

size_t kiln_dtype_size(kiln_dtype dt)
{
    return (unsigned)dt < KILN_DTYPE_COUNT ? dtypes[dt].size : 0;
}

bool kiln_dtype_is_float(kiln_dtype dt)
{
    return (unsigned)dt < KILN_DTYPE_COUNT && dtypes[dt].is_float;
}

bool kiln_dtype_is_f32_or_half(kiln_dtype dt) { return kiln__f32_or_half(dt); }

kiln_status kiln_dtype_parse(const char *name, kiln_dtype *out)
{
    for (int i = 0; name && i < KILN_DTYPE_COUNT; i++) {
        if (!strcmp(name, dtypes[i].name) || !strcmp(name, dtypes[i].alias)) {
            *out = (kiln_dtype)i;
            return KILN_OK;
        }
    }
    return kiln__err(KILN_ERR_DTYPE, "unknown dtype '%s' (try f32, f64, f16, bf16, i32, i64, u8, bool)",
                     name ? name : "(null)");
}
