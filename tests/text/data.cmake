# Datasets and verifiers of the text layer (included from tests/text/CMakeLists.txt).
add_executable(text_data_test ${CMAKE_CURRENT_LIST_DIR}/data_dataset_test.cpp
                              ${CMAKE_CURRENT_LIST_DIR}/data_examples_test.cpp)
target_link_libraries(text_data_test PRIVATE moerl_text GTest::gtest_main)
target_compile_definitions(text_data_test PRIVATE MOERL_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
gtest_discover_tests(text_data_test PROPERTIES LABELS "text" DISCOVERY_TIMEOUT 60)

add_executable(text_verifier_test ${CMAKE_CURRENT_LIST_DIR}/verifier_math_test.cpp
                                  ${CMAKE_CURRENT_LIST_DIR}/verifier_countdown_test.cpp
                                  ${CMAKE_CURRENT_LIST_DIR}/verifier_match_test.cpp
                                  ${CMAKE_CURRENT_LIST_DIR}/verifier_external_test.cpp)
target_link_libraries(text_verifier_test PRIVATE moerl_text GTest::gtest_main)
gtest_discover_tests(text_verifier_test PROPERTIES LABELS "text" DISCOVERY_TIMEOUT 60)

# The checked-in example dataset is what its generator writes.
add_test(NAME text_math_dataset_reproducible
         COMMAND sh -c "out=$(mktemp -d) && python3 '${PROJECT_SOURCE_DIR}/scripts/make_math_dataset' --out \"$out\" \
&& cmp \"$out/arith.jsonl\" '${PROJECT_SOURCE_DIR}/examples/data/arith.jsonl' \
&& cmp \"$out/arith_eval.jsonl\" '${PROJECT_SOURCE_DIR}/examples/data/arith_eval.jsonl'; rc=$?; rm -rf \"$out\"; exit $rc")
set_tests_properties(text_math_dataset_reproducible PROPERTIES LABELS "text")
