# Datasets and verifiers of the text layer (included from tests/text/CMakeLists.txt).
add_executable(text_data_test ${CMAKE_CURRENT_LIST_DIR}/data_dataset_test.cpp)
target_link_libraries(text_data_test PRIVATE moerl_text GTest::gtest_main)
gtest_discover_tests(text_data_test PROPERTIES LABELS "text" DISCOVERY_TIMEOUT 60)

add_executable(text_verifier_test ${CMAKE_CURRENT_LIST_DIR}/verifier_math_test.cpp
                                  ${CMAKE_CURRENT_LIST_DIR}/verifier_countdown_test.cpp
                                  ${CMAKE_CURRENT_LIST_DIR}/verifier_match_test.cpp
                                  ${CMAKE_CURRENT_LIST_DIR}/verifier_external_test.cpp)
target_link_libraries(text_verifier_test PRIVATE moerl_text GTest::gtest_main)
gtest_discover_tests(text_verifier_test PROPERTIES LABELS "text" DISCOVERY_TIMEOUT 60)

