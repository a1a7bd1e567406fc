# The hostile CLI suite (tests/hostile/): the kiln program fed what a careless or hostile
# user gives it, one file a class of defect (issue 51). Each case checks the exit
# status, the message and that nothing outside the command's output was touched
# (hostile.py). One ctest a file, so a failure names its class.
if(NOT KILN_PYTHON3)
  find_program(KILN_PYTHON3 python3)
endif()
if(KILN_PYTHON3)
  # A disk that fills up, for the save cases, and a file slow to open, for the signal
  # cases (shim.c: an LD_PRELOAD module, so it runs wherever the suite does, without
  # the right to mount a small tmpfs).
  add_library(hostile_shim MODULE tests/hostile/shim.c)
  target_link_libraries(hostile_shim PRIVATE ${CMAKE_DL_LIBS})
  file(GLOB KILN_HOSTILE_TESTS ${CMAKE_SOURCE_DIR}/tests/hostile/test_*.py)
  foreach(t ${KILN_HOSTILE_TESTS})
    get_filename_component(n ${t} NAME_WE)
    string(REPLACE "test_" "hostile_" n ${n})
    add_test(NAME ${n} COMMAND ${KILN_PYTHON3} ${t} --kiln $<TARGET_FILE:kiln_tool>
             --workdir ${CMAKE_BINARY_DIR}/hostile-tests/${n} --shim $<TARGET_FILE:hostile_shim>)
    # Under the sanitizers a crash or a use of freed memory fails a case, but memory the
    # kiln program has not freed when it exits on an error does not: what is leaked at
    # an exit is given back by the exit. The library's own error paths are checked for
    # leaks by tests/fault (every allocation failing in turn, LeakSanitizer on).
    set_tests_properties(${n} PROPERTIES TIMEOUT 600 LABELS hostile
                         ENVIRONMENT "${KILN_LSAN_ENV};ASAN_OPTIONS=detect_leaks=0")
  endforeach()
endif()
