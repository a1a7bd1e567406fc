# The server's end-to-end tests: the real `kiln serve` binary on a free loopback port,
# driven by Python (standard library, then the openai package) and headless Chromium.
# Exit code 77 is a skip (a missing optional tool), never a pass.
# scripts/install-test-deps.sh installs what they need, and a venv with openai.
# Debian's python3 first: the Debian packages (python3-websocket) install for it.
find_program(KILN_PYTHON3 python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(NOT KILN_PYTHON3)
  find_program(KILN_PYTHON3 python3)
endif()
if(KILN_PYTHON3)
  set(KILN_SERVE_TEST_ARGS --kiln $<TARGET_FILE:kiln_tool> --workdir ${CMAKE_BINARY_DIR}/serve-tests)
  set(KILN_VENV_PYTHON ${CMAKE_SOURCE_DIR}/build/venv/bin/python)
  add_test(NAME serve_http COMMAND ${KILN_PYTHON3} ${CMAKE_SOURCE_DIR}/tests/serve/test_serve_http.py ${KILN_SERVE_TEST_ARGS})
  add_test(NAME serve_openai COMMAND sh -c "py=${KILN_VENV_PYTHON}; [ -x \"$py\" ] || py=${KILN_PYTHON3}; exec \"$py\" \"$@\"" sh
           ${CMAKE_SOURCE_DIR}/tests/serve/test_serve_openai.py ${KILN_SERVE_TEST_ARGS})
  add_test(NAME serve_reqlog COMMAND ${KILN_PYTHON3} ${CMAKE_SOURCE_DIR}/tests/serve/test_serve_reqlog.py ${KILN_SERVE_TEST_ARGS})
  add_test(NAME serve_page COMMAND ${KILN_PYTHON3} ${CMAKE_SOURCE_DIR}/tests/serve/test_serve_page.py ${KILN_SERVE_TEST_ARGS})
  set_tests_properties(serve_http serve_openai serve_reqlog serve_page PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600
                       RESOURCE_LOCK kiln_serve)
endif()
