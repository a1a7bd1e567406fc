# libFuzzer targets, built by scripts/fuzz.sh with clang (-DKILN_FUZZ=ON, which also
# builds the whole library with the fuzzer's coverage and ASan+UBSan: CMakeLists.txt),
# not by the normal build:
#   fuzz_openai       the server's request parser, chat templates and text stream
#   fuzz_flex         flex attention's modifier expressions and preset specs
#   fuzz_model_files  Hugging Face config.json, tokenizer.json, safetensors files
#   fuzz_gguf         GGUF files: the header, metadata, tensor table and every tensor read
if(KILN_FUZZ)
  if(NOT CMAKE_C_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "KILN_FUZZ needs clang (CC=clang), not ${CMAKE_C_COMPILER_ID}")
  endif()
  add_executable(fuzz_openai tests/fuzz/fuzz_openai.c src/serve/openai.c src/serve/chat.c)
  target_include_directories(fuzz_openai PRIVATE include src)
  target_link_options(fuzz_openai PRIVATE -fsanitize=fuzzer)
  target_link_libraries(fuzz_openai PRIVATE ${JANSSON_LIB})
  foreach(t fuzz_flex fuzz_model_files fuzz_gguf)
    add_executable(${t} tests/fuzz/${t}.c)
    target_include_directories(${t} PRIVATE include src tests/fuzz)
    target_link_options(${t} PRIVATE -fsanitize=fuzzer)
    target_link_libraries(${t} PRIVATE kiln)
  endforeach()
endif()
