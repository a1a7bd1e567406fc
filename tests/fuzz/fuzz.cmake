# The libFuzzer target over the request parser and the text stream; built by
# scripts/fuzz.sh with clang (-DKILN_FUZZ=ON), not by the normal build.
option(KILN_FUZZ "Build the libFuzzer target fuzz_openai (needs clang)" OFF)
if(KILN_FUZZ)
  if(NOT CMAKE_C_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "KILN_FUZZ needs clang (CC=clang), not ${CMAKE_C_COMPILER_ID}")
  endif()
  add_executable(fuzz_openai tests/fuzz/fuzz_openai.c src/serve/openai.c src/serve/chat.c)
  target_include_directories(fuzz_openai PRIVATE include src)
  target_compile_options(fuzz_openai PRIVATE -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined)
  target_link_options(fuzz_openai PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(fuzz_openai PRIVATE ${JANSSON_LIB})
endif()
