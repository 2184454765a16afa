//! GPU details from the CUDA driver (cargo feature `cuda`): model name, memory and the driver's
//! view of each device's PCI bus id, merged into the GPUs that PCI discovery found. I/O
//! boundary: the CUDA driver library, loaded at run time (cudarc `dynamic-loading`); without a
//! driver this reports an error instead of panicking. Holds this feature's only `unsafe`.

use cudarc::driver::{result, sys};

use crate::topology::{CudaDetails, Topology, Warning};

/// Errors of the CUDA probe.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum CudaProbeError {
    #[error("no CUDA driver library on this machine")]
    NoDriver,
    #[error("CUDA driver call {call} failed: {message}")]
    Driver { call: &'static str, message: String },
}

kvpool_runtime::error_category!(CudaProbeError);

fn driver(call: &'static str) -> impl Fn(result::DriverError) -> CudaProbeError {
    move |e| CudaProbeError::Driver {
        call,
        message: format!("{e:?}"),
    }
}

/// Ask the driver about every device.
pub fn probe() -> Result<Vec<(String, CudaDetails)>, CudaProbeError> {
    // SAFETY: only checks whether the shared library can be loaded; cudarc panics on the first
    // real call when it cannot, which this guards against.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaProbeError::NoDriver);
    }
    result::init().map_err(driver("cuInit"))?;
    let count = result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
    let mut out = Vec::new();
    for ordinal in 0..count {
        let dev = result::device::get(ordinal).map_err(driver("cuDeviceGet"))?;
        let name = result::device::get_name(dev).map_err(driver("cuDeviceGetName"))?;
        // SAFETY: `dev` was returned by cuDeviceGet for a valid ordinal.
        let (memory, domain, bus, device) = unsafe {
            (
                result::device::total_mem(dev).map_err(driver("cuDeviceTotalMem"))?,
                result::device::get_attribute(
                    dev,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID,
                )
                .map_err(driver("cuDeviceGetAttribute"))?,
                result::device::get_attribute(
                    dev,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID,
                )
                .map_err(driver("cuDeviceGetAttribute"))?,
                result::device::get_attribute(
                    dev,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID,
                )
                .map_err(driver("cuDeviceGetAttribute"))?,
            )
        };
        let bus_id = format!("{domain:04x}:{bus:02x}:{device:02x}.0");
        out.push((
            bus_id,
            CudaDetails {
                ordinal: u32::try_from(ordinal).unwrap_or(0),
                name,
                memory_bytes: memory as u64,
            },
        ));
    }
    Ok(out)
}

/// Merge the driver's details into the topology's GPUs (by bus id); problems become warnings.
pub fn enrich(topo: &mut Topology) {
    match probe() {
        Ok(devices) => {
            for (bus_id, details) in devices {
                match topo.gpus.iter_mut().find(|g| g.pci_bus_id == bus_id) {
                    Some(gpu) => gpu.cuda = Some(details),
                    None => topo.warnings.push(Warning {
                        path: "cuda".to_owned(),
                        message: format!(
                            "CUDA device {} ({bus_id}) not found on the PCI bus",
                            details.ordinal
                        ),
                    }),
                }
            }
        }
        Err(e) => topo.warnings.push(Warning {
            path: "cuda".to_owned(),
            message: e.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_reports_instead_of_panicking() {
        let mut topo = Topology::default();
        enrich(&mut topo);
        // With a driver and no PCI GPUs in an empty topology every device is a warning; with
        // no driver there is exactly one warning. Either way: no panic, something reported.
        match probe() {
            Err(CudaProbeError::NoDriver) => {
                println!("SKIP: no CUDA driver here; checked the no-driver path only");
                assert_eq!(topo.warnings.len(), 1);
            }
            Ok(devices) => assert_eq!(topo.warnings.len(), devices.len()),
            Err(e) => assert_eq!(topo.warnings.len(), 1, "{e}"),
        }
    }
}
