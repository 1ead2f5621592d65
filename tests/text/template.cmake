# Chat templates (label `text`): unit tests of the Jinja subset and its errors, and the
# conformance test against @huggingface/jinja. template_reference.mjs renders every case with the
# reference (npm packages in the repository's node_modules) into template_expected.json; the C++
# test renders the same cases and compares byte for byte.
add_executable(text_template_test ${CMAKE_CURRENT_LIST_DIR}/template_test.cpp
                                  ${CMAKE_CURRENT_LIST_DIR}/template_conformance_test.cpp)
target_link_libraries(text_template_test PRIVATE moerl_text GTest::gtest_main)
target_compile_definitions(text_template_test PRIVATE
  MOERL_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
  MOERL_TEMPLATE_EXPECTED="${CMAKE_CURRENT_BINARY_DIR}/template_expected.json")

find_program(NODE_EXECUTABLE node)
if(NODE_EXECUTABLE)
  add_test(NAME text_template_reference
           COMMAND ${NODE_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/template_reference.mjs
                   ${CMAKE_CURRENT_BINARY_DIR}/template_expected.json
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(text_template_reference PROPERTIES LABELS "text" FIXTURES_SETUP template_reference)
else()
  message(WARNING "node not found: the chat-template conformance test will be skipped")
  target_compile_definitions(text_template_test PRIVATE MOERL_TEMPLATE_NO_REFERENCE=1)
endif()
gtest_discover_tests(text_template_test PROPERTIES LABELS "text" FIXTURES_REQUIRED template_reference
                     DISCOVERY_TIMEOUT 60)
