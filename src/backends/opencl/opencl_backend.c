/* The OpenCL backend: one registered backend per OpenCL device ("opencl:0", ...),
 * through the ICD loader, so any installed platform works (PoCL on these machines).
 *
 * A device's buffers are given ranges of host addresses that stand for them, so that a
 * tensor's pointer plus offset works as on the cpu (opencl_device.c); work goes to one
 * in-order queue per device. Kernels come from source: the compiler's generated ones
 * and the backend's own (kernels.cl), built once and kept in the kernel cache
 * (opencl_program.c); the ops the backend runs itself are in opencl_ops.c, and an op
 * neither they nor the compiler cover runs on the cpu with copies (src/core/dispatch.c).
 * Where the platform has cl_khr_command_buffer, a capture records the queue's work into
 * a command buffer that a replay enqueues (opencl_capture.c).
 *
 * This file is the backend table and the registration; opencl_impl.h is what the files
 * share. */
#ifdef KILN_HAVE_OPENCL
#include <stdlib.h>
#include "backends/opencl/opencl_impl.h"
#include "kiln/tensor.h"

static cl_dev devs[MAX_CL_DEVICES];
static kiln__backend cl_backends[MAX_CL_DEVICES];

static int n_open;

/* At exit, every queue is finished first: work still queued (an in-place update nobody
 * read back) would otherwise be running, or being compiled by the platform's threads,
 * while the process tears down the platform's compiler under them (PoCL crashes so). */
static void finish_all(void)
{
    for (int i = 0; i < n_open; i++) clFinish(devs[i].q);
}

/* Registers every OpenCL device found; none (no platform, no ICD) is not an error. */
static int opencl_register(int nthreads)
{
    cl_platform_id plats[8];
    cl_uint np = 0;
    if (clGetPlatformIDs(8, plats, &np) != CL_SUCCESS) return 0;
    int n = 0;
    for (cl_uint p = 0; p < np && n < MAX_CL_DEVICES; p++) {
        cl_device_id ids[MAX_CL_DEVICES];
        cl_uint nd = 0;
        if (clGetDeviceIDs(plats[p], CL_DEVICE_TYPE_ALL, MAX_CL_DEVICES, ids, &nd) != CL_SUCCESS) continue;
        for (cl_uint i = 0; i < nd && n < MAX_CL_DEVICES; i++) {
            if (kiln__opencl_open_device(&devs[n], plats[p], ids[i], n) != KILN_OK) {
                kiln_clear_error();
                continue;
            }
            kiln__backend *be = &cl_backends[n];
            /* Capture where the platform has command buffers; not yet: pinned host memory. */
            bool cb = devs[n].cb_create != NULL;
            *be = (kiln__backend){
                .abi_version = KILN_BACKEND_ABI_VERSION,
                .name = devs[n].name,
                .ctx = &devs[n],
                .device_info = kiln__opencl_device_info,
                .alloc = kiln__opencl_alloc,
                .free = kiln__opencl_free,
                .copy_h2d = kiln__opencl_copy_h2d,
                .copy_d2h = kiln__opencl_copy_d2h,
                .copy_d2d = kiln__opencl_copy_d2d,
                .memset = kiln__opencl_memset,
                .event_record = kiln__opencl_event_record,
                .event_wait = kiln__opencl_event_wait,
                .event_free = kiln__opencl_event_free,
                .synchronize = kiln__opencl_synchronize,
                .kernels = kiln__opencl_kernels,
                .language = "opencl-c",
                .compile_kernel = kiln__opencl_compile_kernel,
                .kernel_free = kiln__opencl_kernel_free,
                .launch = kiln__opencl_launch,
                .fill = kiln__opencl_fill,
                .event_query = kiln__opencl_event_query,
                .capture_begin = cb ? kiln__opencl_capture_begin : NULL,
                .capture_end = cb ? kiln__opencl_capture_end : NULL,
                .replay = cb ? kiln__opencl_replay : NULL,
                .capture_reset = cb ? kiln__opencl_capture_reset : NULL,
            };
            if (kiln__backend_register(be) == KILN_OK) {
                n++;
                if (n_open++ == 0) atexit(finish_all);
                continue;
            }
            kiln_clear_error(); /* no room: the device is closed again */
            clReleaseCommandQueue(devs[n].q);
            clReleaseContext(devs[n].ctx);
        }
    }
    return n;
}
KILN__REGISTER(register_opencl) { kiln__backend_provider_register("opencl", opencl_register, false); }
#endif
