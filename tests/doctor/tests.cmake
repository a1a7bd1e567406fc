# kiln doctor against a broken stack (tests/doctor/): a compiler that is not there, an
# unwritable kernel cache, a slow resolver (an LD_PRELOAD module that delays
# getaddrinfo), an invalid KILN_* value; --json against the text form, and the exit
# status against the verdicts.
if(NOT KILN_PYTHON3)
  find_program(KILN_PYTHON3 python3)
endif()
if(KILN_PYTHON3)
  add_library(slow_resolver MODULE tests/doctor/slow_resolver.c)
  target_link_libraries(slow_resolver PRIVATE ${CMAKE_DL_LIBS})
  add_test(NAME doctor COMMAND ${KILN_PYTHON3} ${CMAKE_SOURCE_DIR}/tests/doctor/test_doctor.py
           --kiln $<TARGET_FILE:kiln_tool> --preload $<TARGET_FILE:slow_resolver>
           --workdir ${CMAKE_BINARY_DIR}/doctor-tests --docs ${CMAKE_SOURCE_DIR}/docs/doctor.md)
  # Under the ASan build: the OpenCL platform's own leftovers are not reported, as for
  # test_cli's kiln doctor (tests/lsan.supp).
  set_tests_properties(doctor PROPERTIES TIMEOUT 300 ENVIRONMENT "${KILN_LSAN_ENV}")
endif()
