# The fabric transport's tests (included from tests/ep/CMakeLists.txt).
if(MOERL_WITH_FABRIC)
  add_executable(ep_fabric_transport_test ${CMAKE_CURRENT_LIST_DIR}/fabric_transport_test.cpp)
  target_link_libraries(ep_fabric_transport_test PRIVATE moerl_ep moerl_libfabric GTest::gtest_main)
  # The test reaches into src/ep for the fabric internals it checks (signal code, provider probe).
  target_include_directories(ep_fabric_transport_test PRIVATE ${PROJECT_SOURCE_DIR}/src/ep)
  gtest_discover_tests(ep_fabric_transport_test PROPERTIES LABELS "ep" DISCOVERY_TIMEOUT 60)
endif()
