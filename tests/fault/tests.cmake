# Allocation fault injection (tests/fault/): fault_sweep runs kiln's API with each of a
# scenario's allocations failing in turn (every allocation function wrapped at link
# time), in the normal build and under ASan (where a leak fails the run too).
add_executable(fault_sweep tests/fault/fault_sweep.c tests/fault/fault_alloc.c)
target_link_libraries(fault_sweep PRIVATE kiln ${JANSSON_LIB})
target_include_directories(fault_sweep PRIVATE src)
target_link_options(fault_sweep PRIVATE -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=strdup,--wrap=strndup
                    -Wl,--wrap=aligned_alloc,--wrap=posix_memalign)
# In make test each scenario's allocations are sampled (at most 300 runs a scenario);
# `build/fault_sweep` alone fails every one of them in turn (about two minutes).
add_test(NAME fault_alloc COMMAND fault_sweep --max-runs 300)
set_tests_properties(fault_alloc PROPERTIES TIMEOUT 1200 ENVIRONMENT "${KILN_LSAN_ENV}")
