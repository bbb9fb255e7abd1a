include(CMakePackageConfigHelpers)

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/kvq" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(TARGETS kvq EXPORT kvqTargets)
install(EXPORT kvqTargets NAMESPACE kvq:: DESTINATION "${CMAKE_INSTALL_DATADIR}/cmake/kvq")

configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/kvqConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/kvqConfig.cmake" INSTALL_DESTINATION "${CMAKE_INSTALL_DATADIR}/cmake/kvq")
# Header-only: any architecture may consume it.
write_basic_package_version_file("${PROJECT_BINARY_DIR}/kvqConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES "${PROJECT_BINARY_DIR}/kvqConfig.cmake" "${PROJECT_BINARY_DIR}/kvqConfigVersion.cmake"
  DESTINATION "${CMAKE_INSTALL_DATADIR}/cmake/kvq")
