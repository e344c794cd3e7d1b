// Internal: the few NVML types, constants and entry points ElasticCore uses, declared here so
// that no CUDA or NVML header is needed to build. Values follow NVIDIA's nvml.h (NVML 12).
#pragma once

namespace elastic::nvml {

using Return = int;
using Device = struct nvmlDevice_st*;
using EventSet = struct nvmlEventSet_st*;

// nvmlEventData_t as of NVML 11+; older drivers fill only the first three fields.
struct EventData {
  Device device;
  unsigned long long event_type;
  unsigned long long event_data;  // the XID for XID events
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};

constexpr Return kSuccess = 0;
constexpr Return kErrorNotSupported = 3;
constexpr Return kErrorTimeout = 10;
constexpr Return kErrorGpuIsLost = 15;

constexpr unsigned long long kEventXidCriticalError = 0x8;
constexpr int kMemoryErrorUncorrected = 1;  // nvmlMemoryErrorType_t
constexpr int kVolatileEcc = 0;             // nvmlEccCounterType_t
constexpr int kFeatureEnabled = 1;          // nvmlEnableState_t

// nvmlClocksEventReason* / nvmlClocksThrottleReason* bits.
constexpr unsigned long long kReasonHwSlowdown = 0x8;
constexpr unsigned long long kReasonSwThermalSlowdown = 0x20;
constexpr unsigned long long kReasonHwThermalSlowdown = 0x40;
constexpr unsigned long long kReasonHwPowerBrakeSlowdown = 0x80;

// Entry points, resolved with dlsym. The first five are required.
struct Api {
  Return (*init)() = nullptr;                                   // nvmlInit_v2
  Return (*shutdown)() = nullptr;                               // nvmlShutdown
  const char* (*error_string)(Return) = nullptr;                // nvmlErrorString
  Return (*device_count)(unsigned int*) = nullptr;              // nvmlDeviceGetCount_v2
  Return (*handle_by_index)(unsigned int, Device*) = nullptr;   // nvmlDeviceGetHandleByIndex_v2
  Return (*uuid)(Device, char*, unsigned int) = nullptr;        // nvmlDeviceGetUUID
  Return (*total_ecc)(Device, int, int, unsigned long long*) = nullptr;  // GetTotalEccErrors
  Return (*pages_pending)(Device, int*) = nullptr;  // nvmlDeviceGetRetiredPagesPendingStatus
  Return (*remapped_rows)(Device, unsigned int*, unsigned int*, unsigned int*,
                          unsigned int*) = nullptr;  // nvmlDeviceGetRemappedRows
  Return (*clock_reasons)(Device, unsigned long long*) = nullptr;  // ...ClocksEventReasons
  Return (*event_set_create)(EventSet*) = nullptr;                 // nvmlEventSetCreate
  Return (*register_events)(Device, unsigned long long, EventSet) = nullptr;
  Return (*event_wait)(EventSet, EventData*, unsigned int) = nullptr;  // nvmlEventSetWait_v2
  Return (*event_set_free)(EventSet) = nullptr;                        // nvmlEventSetFree
};

}  // namespace elastic::nvml
