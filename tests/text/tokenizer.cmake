# Tokenizer tests (label `text`): conformance with Hugging Face's tokenizers through node and the npm
# packages at the repository root (scripts/setup installs them).
find_program(MOERL_NODE node)
if(NOT MOERL_NODE)
  set(MOERL_NODE /usr/bin/node)
endif()
add_executable(tokenizer_test ${CMAKE_CURRENT_LIST_DIR}/tokenizer_test.cpp)
pkg_check_modules(TOKENIZER_TEST_UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)
target_link_libraries(tokenizer_test PRIVATE moerl_text PkgConfig::TOKENIZER_TEST_UTF8PROC GTest::gtest_main)
target_compile_definitions(tokenizer_test PRIVATE MOERL_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                                                  MOERL_NODE_EXECUTABLE="${MOERL_NODE}")
gtest_discover_tests(tokenizer_test PROPERTIES LABELS "text" TIMEOUT 600 DISCOVERY_TIMEOUT 60)
