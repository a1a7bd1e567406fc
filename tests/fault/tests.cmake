# Allocation fault injection (tests/fault/): fault_sweep runs kiln's API with each of a
# scenario's allocations failing in turn (every allocation function wrapped at link
# time), in the normal build and under ASan (where a leak fails the run too).
add_executable(fault_sweep tests/fault/fault_sweep.c tests/fault/fault_alloc.c)
target_link_libraries(fault_sweep PRIVATE kiln ${JANSSON_LIB})
target_include_directories(fault_sweep PRIVATE src)
target_link_options(fault_sweep PRIVATE -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=strdup,--wrap=strndup
                    -Wl,--wrap=aligned_alloc,--wrap=posix_memalign)
# One ctest case a scenario, sampled: at most 300 runs each (every k-th allocation of a
# longer one), about 10 seconds a case under ASan. `build/fault_sweep` alone fails every
# allocation of every scenario in turn (docs/reliability.md: the counts and the times).
set(KILN_FAULT_SCENARIOS autograd safetensors tokenizer gpt hf_load flex graph compiled serve optim dist
    flex_attention train_step export openai)
foreach(sc ${KILN_FAULT_SCENARIOS})
  add_test(NAME fault_alloc_${sc} COMMAND fault_sweep ${sc} --max-runs 300)
  set_tests_properties(fault_alloc_${sc} PROPERTIES TIMEOUT 600 LABELS fault ENVIRONMENT "${KILN_LSAN_ENV}")
endforeach()
# The list above is fault_sweep's table of scenarios, so that a new one gets its case.
list(JOIN KILN_FAULT_SCENARIOS " " fault_list)
add_test(NAME fault_alloc_scenarios COMMAND fault_sweep --list)
set_tests_properties(fault_alloc_scenarios PROPERTIES LABELS fault PASS_REGULAR_EXPRESSION "^${fault_list}\n$")
