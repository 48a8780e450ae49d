# Install rules (component `kda`): libkda.a, the public headers (with the configured version.h),
# the `kda` program and the CMake package, so that a consumer writes
#   find_package(kda 0.1 REQUIRED)
#   target_link_libraries(app PRIVATE kda::kda)
# with CMAKE_PREFIX_PATH pointing at the install prefix. kda::kda carries its link dependencies
# (Threads; with the CUDA backend, CUDA::cudart_static and through it libdl and librt).
include(CMakePackageConfigHelpers)
set(KDA_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/kda
    CACHE STRING "Where the kda CMake package files are installed (relative to the prefix)")

set_target_properties(kda_cli PROPERTIES EXPORT_NAME cli)
install(TARGETS kda kda_cli EXPORT kdaTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT kda
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT kda)
install(DIRECTORY include/kda ${PROJECT_BINARY_DIR}/include/kda
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT kda FILES_MATCHING PATTERN "*.h")
install(EXPORT kdaTargets NAMESPACE kda:: DESTINATION ${KDA_INSTALL_CMAKEDIR} COMPONENT kda)

if(KDA_ENABLE_CUDA)
  get_filename_component(KDA_CUDA_TOOLKIT_ROOT "${CUDAToolkit_BIN_DIR}" DIRECTORY)
endif()
configure_package_config_file(cmake/kdaConfig.cmake.in ${PROJECT_BINARY_DIR}/kdaConfig.cmake
                              INSTALL_DESTINATION ${KDA_INSTALL_CMAKEDIR})
# 0.x: a new minor version may change the API, so only the same major.minor is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/kdaConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/kdaConfig.cmake ${PROJECT_BINARY_DIR}/kdaConfigVersion.cmake
        DESTINATION ${KDA_INSTALL_CMAKEDIR} COMPONENT kda)
