/* Put before every file of the fuzz build (-include, CMakeLists.txt under KILN_FUZZ).
 * The vector kernels' run-time checks name features that clang 14's
 * __builtin_cpu_supports does not know ("f16c", "amx-bf16", "x86-64-v4"), which is a
 * compile error there: the fuzz build says no to every feature and runs the plain C
 * code, which is what the parsers under test call anyway. */
#define __builtin_cpu_supports(feature) 0
