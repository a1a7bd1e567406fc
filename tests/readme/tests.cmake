# The README's recipes, run as written (tests/readme/test_readme.py). Not under the
# sanitizers: the C recipe builds a program against the installed library, which has no
# sanitizer runtime. It runs mpirun, so it takes the lock the MPI tests share.
if(KILN_PYTHON3 AND NOT KILN_SANITIZE)
  add_test(NAME readme_recipes COMMAND ${KILN_PYTHON3} ${CMAKE_SOURCE_DIR}/tests/readme/test_readme.py
           --src ${CMAKE_SOURCE_DIR} --build ${CMAKE_BINARY_DIR} --workdir ${CMAKE_BINARY_DIR}/readme-tests)
  set_tests_properties(readme_recipes PROPERTIES TIMEOUT 1200 RESOURCE_LOCK mpi
                       ENVIRONMENT "${KILN_MPI_TEST_ENV}")
endif()
