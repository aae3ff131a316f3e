# logitserve_add_test(NAME name SOURCES a.cc ... [LIBS lib ...] [LABELS l ...] [TIMEOUT s])
# The one helper that declares a GoogleTest executable and registers its tests with ctest.
# Tests labelled `gpu` skip themselves (GTEST_SKIP) when no device is present.
function(logitserve_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_include_directories(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  target_compile_definitions(${T_NAME} PRIVATE
    LOGITSERVE_BINARY_DIR="${CMAKE_BINARY_DIR}"
    LOGITSERVE_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  if(NOT T_LABELS)
    set(T_LABELS unit)  # an empty LABELS value would swallow the next property name
  endif()
  # Test names are prefixed with the executable's: the CPU and CUDA builds of one suite hold tests
  # of the same name, and ctest keys test properties by name.
  gtest_discover_tests(${T_NAME}
    TEST_PREFIX "${T_NAME}:"
    DISCOVERY_TIMEOUT 60
    PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT}
               # A GTEST_SKIP (e.g. no GPU) is reported by ctest as skipped, never as passed.
               SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
endfunction()
include(GoogleTest)
