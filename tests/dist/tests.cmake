# Data-parallel training under mpirun against one process (tests/dist/). Exit code 77
# is a skip (no mpirun, or a kiln built without MPI), never a pass. Under the ASan
# build, Open MPI's own lifetime allocations are suppressed (tests/dist/lsan.supp); its
# plugins stay loaded so that their frames can be matched. Shared-memory messages are
# copied through the segment rather than by cross-process reads (CMA), which container
# sandboxes often forbid; the tests check results, not bandwidth.
if(KILN_PYTHON3)
  set(KILN_MPI_TEST_ENV "OMPI_MCA_btl_vader_single_copy_mechanism=none;OMPI_MCA_mca_base_component_disable_dlclose=1;LSAN_OPTIONS=suppressions=${CMAKE_SOURCE_DIR}/tests/dist/lsan.supp:fast_unwind_on_malloc=0")
  add_executable(rdzv_probe tests/dist/rdzv_probe.c)
  target_link_libraries(rdzv_probe PRIVATE kiln)
  add_test(NAME dist_rendezvous COMMAND ${KILN_PYTHON3} ${CMAKE_SOURCE_DIR}/tests/dist/test_dist_rendezvous.py
           --probe $<TARGET_FILE:rdzv_probe> --kiln $<TARGET_FILE:kiln_tool>)
  set_tests_properties(dist_rendezvous PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600 RUN_SERIAL TRUE)
  add_executable(dist_probe tests/dist/dist_probe.c)
  target_link_libraries(dist_probe PRIVATE kiln)
  add_test(NAME dist_collectives COMMAND ${KILN_PYTHON3} ${CMAKE_SOURCE_DIR}/tests/dist/test_dist_collectives.py
           --probe $<TARGET_FILE:dist_probe> --workdir ${CMAKE_BINARY_DIR}/dist-tests)
  set_tests_properties(dist_collectives PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600 RESOURCE_LOCK mpi
                       ENVIRONMENT "${KILN_MPI_TEST_ENV}")
  add_test(NAME dist_srun COMMAND ${KILN_PYTHON3} ${CMAKE_SOURCE_DIR}/tests/dist/test_dist_srun.py
           --kiln $<TARGET_FILE:kiln_tool> --workdir ${CMAKE_BINARY_DIR}/dist-tests)
  set_tests_properties(dist_srun PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600 RUN_SERIAL TRUE
                       ENVIRONMENT "${KILN_MPI_TEST_ENV}")
  add_test(NAME dist_train COMMAND ${KILN_PYTHON3} ${CMAKE_SOURCE_DIR}/tests/dist/test_dist_train.py
           --kiln $<TARGET_FILE:kiln_tool> --workdir ${CMAKE_BINARY_DIR}/dist-tests)
  set_tests_properties(dist_train PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600 RESOURCE_LOCK mpi
                       ENVIRONMENT "${KILN_MPI_TEST_ENV}")
  add_test(NAME dist_stop COMMAND ${KILN_PYTHON3} ${CMAKE_SOURCE_DIR}/tests/dist/test_dist_stop.py
           --kiln $<TARGET_FILE:kiln_tool> --workdir ${CMAKE_BINARY_DIR}/dist-tests)
  set_tests_properties(dist_stop PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600 RESOURCE_LOCK mpi ENVIRONMENT "${KILN_MPI_TEST_ENV}")
endif()
